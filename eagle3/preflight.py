"""`eagle3 preflight`: what would stop a hero run on this machine, found before it starts.

A Kimi-K2.5 hero run spends 22 minutes loading the model before the first request and hours of
8 GPUs after that; a missing binary, a unit that is not installed, too few GPUs or a disk that
cannot hold the hidden states should fail in seconds, not after that. Every check reads only:
nothing is started, stopped, downloaded or written. The same checks run as
``python -m flows.hero_run --dry-run`` (with the plan's summary).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from eagle3.config import PipelineConfig

Status = Literal["ok", "warn", "fail"]


@dataclass
class Check:
    name: str
    status: Status
    detail: str


def _nearest_existing(path: Path) -> Path:
    path = path.resolve()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _serving(cfg: PipelineConfig) -> list[Check]:
    s = cfg.serve
    if s.backend == "external":
        return [Check("serve", "ok", f"external server {s.base_url} (checked when the run starts)")]
    out = []
    if s.entrypoint == "module":
        ok = os.access(s.vllm_python, os.X_OK)
        out.append(
            Check(
                "vllm",
                "ok" if ok else "fail",
                f"{s.vllm_python}"
                + ("" if ok else " missing: `make vllm-env` (deploy/setup_vllm_env.sh)"),
            )
        )
    else:
        found = shutil.which(s.vllm_bin)
        out.append(
            Check(
                "vllm",
                "ok" if found else "fail",
                found
                or f"{s.vllm_bin} not found: deploy/setup_vllm_env.sh /opt/vllm (docs/serving.md)",
            )
        )
    if s.backend == "systemd":
        if not shutil.which("systemctl"):
            out.append(
                Check("systemd", "fail", "systemctl not found: the systemd backend needs systemd")
            )
            return out
        from eagle3.serving.systemd import _run, active_state

        units = [s.unit] + ([cfg.verify.speculative_unit] if cfg.verify.speculative_unit else [])
        for unit in units:
            known = _run(["systemctl", "cat", f"{unit}.service"]).returncode == 0
            state = active_state(unit) if known else "not installed"
            status: Status = "ok" if known else "fail"
            detail = f"{unit}: {state}"
            if not known:
                detail += f" (install deploy/systemd/{unit}.service: docs/serving.md)"
            elif unit == s.unit and state == "active":
                detail += (
                    " - the run stops it for the GPU stages and starts it again "
                    "(serve.stop_running_unit)"
                    if s.stop_running_unit
                    else " - the GPU stages will fail while it runs "
                    "(serve.stop_running_unit: false)"
                )
                status = "ok" if s.stop_running_unit else "warn"
            out.append(Check("systemd", status, detail))
    return out


def _target(cfg: PipelineConfig) -> Check:
    t = cfg.target
    if t.is_embedded:
        from eagle3.embedded import EmbeddedModelError, planned_path

        try:
            path, note = planned_path(cfg.paths.cache_dir, t.embedded_name)
            return Check("target", "ok", f"{t.model}: {path} ({note})")
        except EmbeddedModelError as e:
            return Check("target", "fail", f"{t.model}: {e}")
    from eagle3.target_checkpoint import checkpoint_dir

    try:
        path = checkpoint_dir(t.model)
    except FileNotFoundError as e:
        if Path(t.model).is_absolute():
            return Check("target", "fail", str(e))
        return Check("target", "warn", f"{e}. Train needs it after generate.")
    return Check(
        "target", "ok" if (path / "config.json").is_file() else "fail", f"{t.model}: {path}"
    )


def _gpus(cfg: PipelineConfig) -> Check:
    need = max(cfg.serve.tensor_parallel_size, cfg.train.nproc_per_node)
    try:
        import torch

        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - a broken CUDA setup is what this check reports
        have = 0
    if need <= 1:
        return Check(
            "gpus", "ok", f"{have} visible; the profile needs at most one (or none: vLLM CPU)"
        )
    status: Status = "ok" if have >= need else "fail"
    return Check(
        "gpus",
        status,
        f"{have} visible, the profile needs {need} (serve.tensor_parallel_size "
        f"{cfg.serve.tensor_parallel_size}, train.nproc_per_node {cfg.train.nproc_per_node})",
    )


def extract_bytes_upper_bound(cfg: PipelineConfig) -> int | None:
    """The disk the profile's state layout takes at most, every sample at full length: offline,
    3 aux + 1 final state per token; online, token ids and masks; hybrid, + a numeric
    ``train.state_cache_gib`` (all of it may land on disk). ``auto`` adds nothing: that cache
    takes only what the disk has free less the margin (eagle3/plan_states.py)."""
    from eagle3.plan_states import (
        GIB,
        TOKEN_BYTES,
        profile_layout,
        state_bytes_per_token,
        tokens_bound,
    )

    tokens = tokens_bound(cfg)
    if tokens is None:
        return None
    layout, budget = profile_layout(cfg), cfg.train.state_cache_gib
    if layout == "offline":
        return tokens * state_bytes_per_token(cfg)
    cache = 0 if isinstance(budget, str) else int(budget * GIB)
    return tokens * TOKEN_BYTES + min(cache, tokens * state_bytes_per_token(cfg))


def _size(n: float) -> str:
    return f"{n / 1024**3:.0f} GiB" if n >= 1024**3 else f"{n / 1024**2:.0f} MiB"


def _layout_words(cfg: PipelineConfig) -> str:
    from eagle3.plan_states import profile_layout

    layout, budget = profile_layout(cfg), cfg.train.state_cache_gib
    if layout == "offline":
        return "states offline"
    if layout == "online":
        return "states online: tokens, no cache"
    if isinstance(budget, str):
        return "states hybrid: tokens + a cache of what the disk has free less the margin (auto)"
    return f"states hybrid: tokens + {budget:g} GiB cache"


def _disk(cfg: PipelineConfig) -> Check:
    """The disk the profile's layout needs against the free space here, and the layout the plan
    would pick on this machine (its disk and host memory, measured) where that differs."""
    from eagle3.plan_states import layout_pick, profile_layout

    where = _nearest_existing(cfg.paths.runs_dir)
    free = shutil.disk_usage(where).free
    need = extract_bytes_upper_bound(cfg)
    if need is None:
        return Check(
            "disk", "ok", f"{_size(free)} free at {where} (generate.num_samples unset: no estimate)"
        )
    samples = f"{cfg.generate.num_samples} samples" + (
        f" + {cfg.extract.dataset_answers} dataset answers" if cfg.extract.dataset_answers else ""
    )
    detail = (
        f"{_size(free)} free at {where}; extract stores at most {_size(need)} "
        f"({samples} at full length, {cfg.extract.storage_dtype}, {_layout_words(cfg)})"
    )
    chosen = layout_pick(cfg)
    if chosen is not None and chosen != profile_layout(cfg):
        detail += f"; on this machine the plan picks {chosen} (eagle3 plan says why)"
    if free >= need:
        return Check("disk", "ok", detail)
    # answers are usually far shorter than max_tokens: a quarter of the bound is where it gets tight
    return Check("disk", "fail" if free < need / 4 else "warn", detail)


def _dataset(cfg: PipelineConfig) -> Check:
    from eagle3.generate.prompts import EMBEDDED_PREFIX, embedded_dataset_path

    d = cfg.generate.dataset
    if d.startswith(EMBEDDED_PREFIX):  # a data file inside an installed package (embedded:sharegpt)
        try:
            return Check(
                "dataset", "ok", f"{d}: {embedded_dataset_path(d[len(EMBEDDED_PREFIX) :])}"
            )
        except (ValueError, FileNotFoundError) as e:
            return Check("dataset", "fail", str(e))
    if Path(d).suffix in (".jsonl", ".json", ".parquet") or Path(d).is_absolute():
        ok = Path(d).is_file()
        return Check("dataset", "ok" if ok else "fail", d + ("" if ok else ": no such file"))
    return Check("dataset", "ok", f"{d} (hub dataset: read at generate; not fetched here)")


def preflight(cfg: PipelineConfig) -> list[Check]:
    return [*_serving(cfg), _target(cfg), _gpus(cfg), _disk(cfg), _dataset(cfg)]


def render(checks: list[Check]) -> str:
    mark = {"ok": "ok  ", "warn": "WARN", "fail": "FAIL"}
    return "\n".join(f"{mark[c.status]} {c.name:<8} {c.detail}" for c in checks)
