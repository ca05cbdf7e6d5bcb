"""Content-addressed stage artifacts: keys, folders, manifests and completeness checks.

Every stage writes into ``<run dir>/<stage>/<key>/`` where the key is a hash of

- the configuration the stage's output depends on (and nothing else: ports, timeouts,
  concurrency, paths and progress settings do not change results, so they do not change keys),
- the stage's code version (``CODE_VERSIONS``: bump it when a change alters what a stage writes),
- the keys of its input artifacts.

So a changed setting reruns exactly the stages whose outputs it can change, and everything
upstream is reused. ``<run dir>/<stage>/latest`` points at the folder the last run used, which
is what the CLI commands read by default ("train on the latest artifacts").

The generate stage is the exception that makes nightly regeneration work: its folder is keyed
by configuration only (target, sampling, which prompts), and it accumulates answers across
runs (the generate library resumes, requesting only what is missing or failed). What
downstream stages depend on is its *content*: the data key hashes the ids of the samples in
the folder, so an unchanged regeneration leaves every later key, and so every later artifact,
as it was.

A folder is complete when its ``artifact.json`` (written last, atomically) names the expected
key and every file it lists is still there with the recorded size. Nothing here imports
Prefect: ``tasks/caching.py`` turns these keys into a Prefect cache policy.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from eagle3.atomic import replace_symlink, write_json_atomic
from eagle3.config import PipelineConfig
from eagle3.generate.storage import is_permanent, iter_samples, latest_errors

STAGES: tuple[str, ...] = ("generate", "extract", "vocab", "train", "verify")
INPUTS: dict[str, tuple[str, ...]] = {
    "generate": (),
    "extract": ("generate",),
    "vocab": ("extract",),
    "train": ("extract", "vocab"),
    "verify": ("train",),
}
# Bump a stage's version when its code changes what it writes: its key and every later key change.
CODE_VERSIONS: dict[str, str] = {
    "generate": "1",
    "extract": "1",
    "vocab": "1",
    "train": "1",
    "verify": "1",
}
MARKER = "artifact.json"
LATEST = "latest"

# Settings that change how fast or where a stage runs, not what it produces.
SERVE_RESULT_FIELDS = (
    "dtype",
    "max_model_len",
    "chat_template",
    "reasoning_parser",
    "tool_call_parser",
)
SERVE_PERF_FIELDS = (
    "tensor_parallel_size",
    "gpu_memory_utilization",
    "enforce_eager",
    "extra_args",
    "env",
)
GENERATE_EXCLUDED = {
    "endpoints",
    "balancing",
    "concurrency",
    "concurrency_ceiling",
    "timeout_s",
    "connect_timeout_s",
    "max_attempts",
    "backoff_base_s",
    "backoff_max_s",
    "retry_rejected",
    "shard_size",
    "profile_levels",
    "profile_prompts",
    "profile_max_tokens",
    "profile_knee",
}
EXTRACT_EXCLUDED = {
    "token_budget",
    "samples_per_shard",
    "chunk_samples",
    "device",
    "vllm_concurrency",
    "reuse_previous",
}
TRAIN_EXCLUDED = {
    "checkpoint_every_steps",
    "distributed",
    "grad_accum",
    "nproc_per_node",
}  # see stage_config
VERIFY_EXCLUDED = {"timeout_s", "speculative_base_url", "speculative_unit", "candidate_link"}


def digest(obj: Any, n: int = 16) -> str:
    """Stable short hash of a JSON-able object (sorted keys, no whitespace)."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str, ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:n]


def _file_digest(path: Path) -> str:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]
    except OSError:
        return "missing"


_target_ids: dict[tuple[str, str], str] = {}


def target_identity(cfg: PipelineConfig) -> dict[str, Any]:
    """What identifies the target's weights and tokenizer (not how it is served or named).

    An embedded target is named by its prepared folder, which carries the hash of the GGUF (or
    of the tiny model's recipe); other targets by their model id or path. ``served_model_name``
    is only a label on the API and is left out.
    """
    t = cfg.target.model_dump(mode="json", exclude={"served_model_name"})
    if cfg.target.is_embedded:
        memo = (cfg.target.model, str(cfg.paths.cache_dir))
        if memo not in _target_ids:
            from eagle3.embedded import planned_path

            _target_ids[memo] = planned_path(cfg.paths.cache_dir, cfg.target.embedded_name)[0].name
        t["model"] = f"{cfg.target.model}@{_target_ids[memo]}"
    return t


def stage_config(cfg: PipelineConfig, stage: str) -> dict[str, Any]:
    """The configuration a stage's output depends on (see the module docstring and docs/orchestration.md)."""
    serve = cfg.serve.model_dump(mode="json")
    if stage == "generate":
        g = cfg.generate.model_dump(mode="json", exclude=GENERATE_EXCLUDED)
        g["exclude_files"] = [
            {"path": str(p), "sha": _file_digest(p)} for p in cfg.generate.exclude_files
        ]
        return {
            "target": target_identity(cfg),
            "generate": g,
            "serve": {k: serve[k] for k in SERVE_RESULT_FIELDS},
        }
    if stage == "extract":
        e = cfg.extract.model_dump(mode="json", exclude=EXTRACT_EXCLUDED)
        e["aux_layers"] = cfg.aux_layers  # resolved: the default depends on the target's depth
        out = {"target": target_identity(cfg), "extract": e}
        if cfg.extract.backend == "vllm":
            out["serve"] = {k: serve[k] for k in ("dtype", "max_model_len")}
        return out
    if stage == "vocab":
        return {
            "vocab": cfg.vocab.model_dump(mode="json"),
            "target_vocab_size": cfg.target.vocab_size,
        }
    if stage == "train":
        t = cfg.train.model_dump(mode="json", exclude=TRAIN_EXCLUDED)
        # One optimizer step takes world size x grad_accum batches: 2 ranks with grad_accum 1 train
        # the same draft as 1 process with grad_accum 2 (DDP or FSDP alike), so that product is the key.
        world = int(
            os.environ.get("WORLD_SIZE") or cfg.train.nproc_per_node
        )  # torchrun's, or the one we launch
        t["batches_per_step"] = world * cfg.train.grad_accum
        return {"target": target_identity(cfg), "train": t, "aux_layers": cfg.aux_layers}
    if stage == "verify":
        return {
            "target": target_identity(cfg),
            "verify": cfg.verify.model_dump(mode="json", exclude=VERIFY_EXCLUDED),
            "serve": {k: serve[k] for k in (*SERVE_RESULT_FIELDS, *SERVE_PERF_FIELDS)},
        }
    raise ValueError(f"unknown stage {stage!r}; stages: {', '.join(STAGES)}")


def stage_key(cfg: PipelineConfig, stage: str, inputs: dict[str, str] | None = None) -> str:
    """hash(stage, code version, the stage's configuration, the keys of its inputs)."""
    inputs = dict(inputs or {})
    missing = [s for s in INPUTS[stage] if s not in inputs]
    if missing:
        raise ValueError(f"stage {stage}: input keys missing for {missing}")
    return digest(
        {
            "stage": stage,
            "code": CODE_VERSIONS[stage],
            "config": stage_config(cfg, stage),
            "inputs": {s: inputs[s] for s in INPUTS[stage]},
        }
    )


def dependants(stages: Iterable[str]) -> set[str]:
    """The given stages and every stage downstream of them."""
    out = set(stages)
    changed = True
    while changed:
        changed = False
        for s, ins in INPUTS.items():
            if s not in out and out.intersection(ins):
                out.add(s)
                changed = True
    return out


# ---------------------------------------------------------------------------
# Folders, manifests, the latest pointer


def artifact_dir(cfg: PipelineConfig, stage: str, key: str) -> Path:
    return cfg.paths.artifact_dir(stage, key)


def _listing(root: Path) -> dict[str, int]:
    """Relative path -> size of every file under ``root`` (hidden temporaries and the marker left out)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            if name.startswith(".") or name == MARKER:
                continue
            p = Path(dirpath) / name
            out[str(p.relative_to(root))] = p.stat().st_size
    return dict(sorted(out.items()))


def seal(
    out_dir: Path,
    stage: str,
    key: str,
    inputs: dict[str, str] | None = None,
    result: dict[str, Any] | None = None,
    config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Mark ``out_dir`` complete: write ``artifact.json`` (atomically, last) with the key, the inputs'
    keys, the stage's configuration, a small result summary and the size of every file."""
    out_dir = Path(out_dir)
    manifest = {
        "stage": stage,
        "key": key,
        "code_version": CODE_VERSIONS[stage],
        "inputs": dict(inputs or {}),
        "config": config,
        "result": result or {},
        "files": _listing(out_dir),
        "sealed_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    write_json_atomic(out_dir / MARKER, manifest)
    return manifest


def read_marker(out_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((Path(out_dir) / MARKER).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def problems(out_dir: Path, key: str | None = None) -> list[str]:
    """Why ``out_dir`` is not a complete artifact (empty list: it is). Stats files, reads nothing big."""
    out_dir = Path(out_dir)
    m = read_marker(out_dir)
    if m is None:
        return [f"{out_dir}: no {MARKER} (never finished)"]
    if key is not None and m.get("key") != key:
        return [f"{out_dir}: {MARKER} names key {m.get('key')}, expected {key}"]
    out = []
    for rel, size in m.get("files", {}).items():
        p = out_dir / rel
        try:
            actual = p.stat().st_size
        except OSError:
            out.append(f"{p}: missing")
            continue
        if actual != size:
            out.append(f"{p}: {actual} bytes, {size} when sealed")
    if not m.get("files"):
        out.append(f"{out_dir}: sealed with no files")
    return out


def is_complete(out_dir: Path, key: str | None = None) -> bool:
    return not problems(out_dir, key)


def set_latest(cfg: PipelineConfig, stage: str, key: str) -> Path:
    """Point ``<run dir>/<stage>/latest`` at ``key`` (a relative symlink, swapped atomically)."""
    link = cfg.paths.stage_root(stage) / LATEST
    if link.is_symlink() and os.readlink(link) == key:
        return link
    return replace_symlink(link, key)


def latest(cfg: PipelineConfig, stage: str) -> tuple[Path, dict[str, Any]] | None:
    """(folder, manifest) of the stage's latest complete artifact, or None."""
    link = cfg.paths.stage_root(stage) / LATEST
    if not link.is_symlink():
        return None
    d = link.resolve()
    m = read_marker(d)
    if m is None or problems(d, m.get("key")):
        return None
    return d, m


# ---------------------------------------------------------------------------
# Generate: what is left to do, and the content key of what is there


@dataclass
class GenerateStatus:
    """Where the generate folder stands against the configured prompt selection (no server needed)."""

    key: str  # the folder's key (configuration only)
    out_dir: str
    selected: int  # prompts the profile selects now
    selection: str  # hash of their ids: new or edited prompts change it
    done: int  # samples in the folder (all runs)
    pending: int  # selected prompts to request: never answered, or failed for a transient reason
    rejected: (
        int  # selected prompts the server rejected for good (retried only with retry_rejected)
    )
    sealed: bool  # a run finished and its files are intact

    @property
    def up_to_date(self) -> bool:
        return self.sealed and self.pending == 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def sample_ids(out_dir: Path) -> list[str]:
    """Ids of the complete samples in a generate folder (read-only; torn tails ignored)."""
    return [r["id"] for r in iter_samples(out_dir)] if Path(out_dir).is_dir() else []


def selected_prompt_ids(cfg: PipelineConfig) -> list[str]:
    """The ids the generate stage would request for this profile (dataset read, nothing sent)."""
    from eagle3.generate.prompts import Prompt, PromptStats
    from eagle3.generate.runner import load_prompts

    return [p.id for p in load_prompts(cfg, PromptStats()) if isinstance(p, Prompt)]


def generate_status(cfg: PipelineConfig, key: str | None = None) -> GenerateStatus:
    """Decide, before any server is started, whether generate has anything to do."""
    key = key or stage_key(cfg, "generate")
    out_dir = artifact_dir(cfg, "generate", key)
    selected = selected_prompt_ids(cfg)
    done = set(sample_ids(out_dir))
    errors = latest_errors(out_dir) if out_dir.is_dir() else {}
    permanent = {i for i, e in errors.items() if is_permanent(e)}
    todo = [i for i in selected if i not in done]
    rejected = sum(1 for i in todo if i in permanent)
    pending = len(todo) - (0 if cfg.generate.retry_rejected else rejected)
    return GenerateStatus(
        key=key,
        out_dir=str(out_dir),
        selected=len(selected),
        selection=digest(sorted(selected)),
        done=len(done),
        pending=pending,
        rejected=rejected,
        sealed=is_complete(out_dir, key),
    )


def data_key(generate_dir: Path, generate_key: str) -> str:
    """Content key of a generate folder: what extract and every later stage depend on.

    A hash of the sample shards' bytes in shard order. Shards are append-only and a sample is
    never written twice, so a regeneration that adds nothing (every retry failed again, or
    nothing was new) leaves it unchanged, while new samples, or a folder regenerated from
    scratch with sampling (different answers under the same ids), change it. Errors are not
    data: a new line in errors.jsonl changes nothing downstream.
    """
    h = hashlib.sha256(generate_key.encode())
    for shard in sorted(Path(generate_dir).glob("samples-*.jsonl*")):
        h.update(shard.name.split(".")[0].encode())
        with open(shard, "rb") as f:
            while block := f.read(1 << 22):
                h.update(block)
    return h.hexdigest()[:16]


def tokens_key(extract_dir: Path, generate_data_key: str) -> str:
    """What the vocab stage reads from an extract folder: the token ids and loss masks of the
    stored samples. They are the generated samples (``generate_data_key``) cut to their stored
    lengths, so hashing the (id, length) pairs identifies them without reading the hidden states:
    a new extraction at other auxiliary layers or in another dtype leaves the vocabulary cached."""
    index = json.loads(
        (Path(extract_dir) / "index.json").read_text()
    )  # id -> [shard, position, length]
    return digest(
        {"data": generate_data_key, "samples": sorted((i, int(v[2])) for i, v in index.items())}
    )


# ---------------------------------------------------------------------------
# What a finished stage records for the stages after it (and for reports)


def summary(
    cfg: PipelineConfig, stage: str, result: dict[str, Any], out_dir: Path, inputs: dict[str, str]
) -> dict[str, Any]:
    """The small summary kept in artifact.json: the keys later stages take (generate's data
    key, extract's token key) and the few numbers a report shows. Paths are relative to the folder."""
    out_dir = Path(out_dir)
    if stage == "generate":
        t = result["totals"]
        return {
            "data_key": data_key(out_dir, out_dir.name),
            "samples": t["samples"],
            "completion_tokens": t["completion_tokens"],
            "errors_by_kind": t["errors_by_kind"],
            "flags": t["flags"],
        }
    if stage == "extract":
        return {
            "tokens_key": tokens_key(out_dir, inputs["generate"]),
            "samples": result["samples"],
            "tokens": result["tokens"],
            "bytes_per_token": result["bytes_per_token"],
            "aux_layers": result["aux_layers"],
            "storage_dtype": result["storage_dtype"],
            # how the folder was filled: computed by the backend, or copied from the previous extract
            "computed": result.get("this_run", {}).get("stored"),
            "reused": result.get("this_run", {}).get("reused", 0),
        }
    if stage == "vocab":
        return {
            "draft_vocab_size": result["draft_vocab_size"],
            "coverage": result["coverage"],
            "loss_tokens": result["loss_tokens"],
        }
    if stage == "train":
        final = result.get("final") or {}
        return {
            "steps": result["steps"],
            "epochs": cfg.train.epochs,
            "samples": result.get("samples"),
            "final_top1": final.get("top1"),
            "final_loss": final.get("loss"),
            "export": "vllm-draft",
        }
    if stage == "verify":
        return {
            "acceptance_length": result.get("acceptance_length"),
            "acceptance_per_position": (result.get("acceptance") or {}).get(
                "acceptance_per_position"
            ),
            "speedup": result.get("speedup"),
            "gate": result.get("gate"),
            "promoted": result.get("promoted"),
        }
    raise ValueError(f"unknown stage {stage!r}")


def input_key(folder: Path, stage: str, for_stage: str) -> str:
    """The key ``for_stage`` takes from the ``stage`` artifact in ``folder``.

    From its artifact.json when sealed; for a folder written some other way (by hand, or before
    keyed folders), from its content: generate's data key, else a hash of its file listing."""
    folder = Path(folder)
    m = read_marker(folder)
    if stage == "generate":
        return (m or {}).get("result", {}).get("data_key") or data_key(folder, folder.name)
    if stage == "extract" and for_stage == "vocab":
        tk = (m or {}).get("result", {}).get("tokens_key")
        if tk:
            return tk
    if m is not None:
        return m["key"]
    return "unsealed-" + digest(_listing(folder))


def plan_stage(
    cfg: PipelineConfig, stage: str, input_dirs: dict[str, Path]
) -> tuple[str, dict[str, str], Path]:
    """(key, input keys, keyed output folder) for running ``stage`` by hand on the given inputs (the CLI)."""
    inputs = {s: input_key(Path(d), s, stage) for s, d in input_dirs.items()}
    key = stage_key(cfg, stage, inputs)
    return key, inputs, artifact_dir(cfg, stage, key)


def finish(
    cfg: PipelineConfig,
    stage: str,
    key: str,
    inputs: dict[str, str],
    out_dir: Path,
    result: dict[str, Any],
) -> None:
    """Seal a stage run by hand; when it wrote its keyed folder, point ``latest`` at it too."""
    out_dir = Path(out_dir)
    seal(
        out_dir,
        stage,
        key,
        inputs,
        summary(cfg, stage, result, out_dir, inputs),
        stage_config(cfg, stage),
    )
    if out_dir.resolve() == artifact_dir(cfg, stage, key).resolve():
        set_latest(cfg, stage, key)


# ---------------------------------------------------------------------------
# A whole run's keys from configuration alone (tests, `eagle3 plan`, the docs' table)


def config_keys(cfg: PipelineConfig, generate_data: str = "data") -> dict[str, str]:
    """Every stage's key assuming generate's content key is ``generate_data``.

    The flow computes the same keys step by step from the real data key; this gives the chain
    in one call, e.g. to show which stages a configuration change reruns.
    """
    keys = {"generate": stage_key(cfg, "generate")}
    data = digest({"generate": keys["generate"], "samples": generate_data})
    keys["extract"] = stage_key(cfg, "extract", {"generate": data})
    # what tokens_key hashes: the same samples cut the same way
    answers = (
        {"dataset_answers": cfg.extract.dataset_answers} if cfg.extract.dataset_answers else {}
    )
    tokens = digest(
        {
            "data": data,
            "max_seq_len": cfg.extract.max_seq_len,
            "truncation": cfg.extract.truncation,
            **answers,
        }
    )
    keys["vocab"] = stage_key(cfg, "vocab", {"extract": tokens})
    keys["train"] = stage_key(cfg, "train", {"extract": keys["extract"], "vocab": keys["vocab"]})
    keys["verify"] = stage_key(cfg, "verify", {"train": keys["train"]})
    return keys


def changed_stages(before: PipelineConfig, after: PipelineConfig) -> list[str]:
    """Stages whose key differs between two configurations (same generate content)."""
    a, b = config_keys(before), config_keys(after)
    return [s for s in STAGES if a[s] != b[s]]
