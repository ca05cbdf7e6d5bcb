"""The stage contract: every stage of the pipeline declared once, run through one ``run_stage``.

A :class:`Stage` says what the CLI (``eagle3/cli.py``), the Prefect tasks (``tasks/``) and the
artifact bookkeeping (``eagle3/artifacts.py``) need to know about it:

- ``name`` and ``inputs``: the stages whose artifacts it reads (the DAG);
- ``code_version`` and ``key_config``: what its cache key hashes besides its inputs' keys (for the
  built-in stages both live in :mod:`eagle3.keys`, which the stages' own modules import without
  importing this contract);
- ``run``: the library call, given a :class:`StageRun` (config, output folder, input folders);
- ``summary``: the small result kept in ``artifact.json`` (the keys later stages take, the few
  numbers a report shows);
- ``files``: the names of what it writes that later stages read, so no caller guesses a path;
- ``gpus``: it needs the GPUs, so a running systemd unit is stopped first (``release_gpus``).

Adding a stage is one module with its library function plus one entry in ``STAGES``: ``eagle3
run-stage`` and the hero run (``tasks/stage.py``) run any entry (docs/orchestration.md, "Adding a
stage").
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3 import artifacts
from eagle3.config import PipelineConfig
from eagle3.input_checks import check_stage_inputs
from eagle3.keys import CODE_VERSIONS, INPUTS, KEY_CONFIG, key_of, keyed, serve_keyed  # noqa: F401
from eagle3.serving.gpus import release_gpus
from eagle3.writer_lock import check_output_dir, writer_lock

VOCAB_FILE = "vocab.safetensors"
DRAFT_DIR = "vllm-draft"


@dataclass
class StageRun:
    """One run of a stage: what its ``run`` function gets."""

    cfg: PipelineConfig
    out_dir: Path
    inputs: dict[str, Path]  # input stage -> its artifact folder
    model: str | None = None  # the target's local folder (resolved by the caller)
    on_progress: Callable[..., None] | None = None
    log: Callable[[str], None] = print
    options: dict[str, Any] = field(default_factory=dict)  # stage-specific (generate's URLs)


@dataclass(frozen=True)
class Stage:
    name: str
    inputs: tuple[str, ...]
    key_config: Callable[[PipelineConfig], dict[str, Any]]
    run: Callable[[StageRun], dict[str, Any]]
    summary: Callable[[StageRun, dict[str, Any]], dict[str, Any]]
    files: dict[str, str] = field(default_factory=dict)
    code_version: str = "1"
    gpus: bool = False

    def file(self, folder: Path, what: str) -> Path:
        """The path of one of this stage's outputs in its artifact ``folder``."""
        return Path(folder) / self.files[what]


# ---------------------------------------------------------------------------
# Keys


def stage_config(cfg: PipelineConfig, stage: str) -> dict[str, Any]:
    """The configuration ``stage``'s output depends on."""
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; stages: {', '.join(NAMES)}")
    return STAGES[stage].key_config(cfg)


def stage_key(cfg: PipelineConfig, stage: str, inputs: dict[str, str] | None = None) -> str:
    """hash(stage, code version, the stage's configuration, the keys of its inputs)."""
    s = STAGES[stage]
    return key_of(stage, s.code_version, stage_config(cfg, stage), s.inputs, inputs)


# ---------------------------------------------------------------------------
# The library calls


def _run_generate(r: StageRun) -> dict[str, Any]:
    """Request every selected prompt not yet answered; without URLs, only report the folder
    (the flow starts no server when nothing is pending)."""
    from eagle3.generate.profile import profile_concurrency
    from eagle3.generate.runner import generate, read_manifest
    from eagle3.generate.status import generate_status

    urls = r.options.get("base_urls") or []
    if not urls:
        status = generate_status(r.cfg, key=r.out_dir.name)
        if status.pending:
            raise RuntimeError(f"generate: {status.pending} prompts to request but no server")
        if not (r.out_dir / "manifest.json").is_file():
            raise FileNotFoundError(
                f"{r.out_dir}: no manifest.json and nothing to request (does the profile select "
                "any prompt?)"
            )
        r.log(f"generate: nothing to request ({status.done} samples in {r.out_dir})")
        return read_manifest(r.out_dir)
    concurrency = r.cfg.generate.concurrency
    if concurrency == "auto":
        report = profile_concurrency(r.cfg, urls, r.out_dir / "profile")
        concurrency = report["knee"]
        r.log(
            f"concurrency auto -> {concurrency} (best {report['best']}, "
            f"{report['best_tokens_per_s']:.0f} tok/s)"
        )
    return generate(
        r.cfg,
        urls,
        r.out_dir,
        concurrency=concurrency,
        tokenizer_path=r.options.get("tokenizer_path"),
        on_progress=r.on_progress,
    )


def _run_extract(r: StageRun) -> dict[str, Any]:
    from eagle3.extract.runner import extract, previous_extract

    reuse = previous_extract(r.cfg, r.out_dir) if r.cfg.extract.reuse_previous else None
    return extract(
        r.cfg, r.inputs["generate"], r.out_dir, r.model, on_progress=r.on_progress, reuse_from=reuse
    )


def _run_vocab(r: StageRun) -> dict[str, Any]:
    from eagle3.vocab import vocab_stage

    c = r.cfg
    # the extract it was built from: train refuses it for another (eagle3.input_checks)
    meta = {"target": c.target.model, "extract_tokens_key": r.options["input_keys"]["extract"]}
    return vocab_stage(
        r.inputs["extract"], r.out_dir, c.target.vocab_size, c.vocab.draft_vocab_size, meta
    )


def _run_train(r: StageRun) -> dict[str, Any]:
    """In this process, or on ``train.nproc_per_node`` local ranks under torchrun (not when this
    process already is a torchrun rank): the CLI and the flow decide the same way."""
    vocab = Path(r.options.get("vocab_file") or STAGES["vocab"].file(r.inputs["vocab"], "vocab"))
    extract_dir, target = r.inputs["extract"], Path(r.model)
    nproc = r.cfg.train.nproc_per_node
    if nproc > 1 and "WORLD_SIZE" not in os.environ:
        from eagle3.train.launch import torchrun_train

        return torchrun_train(r.cfg, extract_dir, vocab, target, r.out_dir, nproc, log=r.log)
    from eagle3.train import train

    return train(r.cfg, extract_dir, vocab, target, r.out_dir, on_progress=r.on_progress)


def _run_verify(r: StageRun) -> dict[str, Any]:
    from eagle3.verify import verify

    draft = Path(r.options.get("draft_dir") or STAGES["train"].file(r.inputs["train"], "draft"))
    return verify(r.cfg, r.model, draft, r.out_dir, log=r.log, on_progress=r.on_progress)


# ---------------------------------------------------------------------------
# What artifact.json keeps (paths relative to the folder)


def _generate_summary(r: StageRun, result: dict[str, Any]) -> dict[str, Any]:
    from eagle3.generate.status import data_key

    t = result["totals"]
    return {
        "data_key": data_key(r.out_dir, r.out_dir.name),
        "samples": t["samples"],
        "completion_tokens": t["completion_tokens"],
        "errors_by_kind": t["errors_by_kind"],
        "flags": t["flags"],
    }


def _extract_summary(r: StageRun, result: dict[str, Any]) -> dict[str, Any]:
    from eagle3.extract.storage import tokens_key

    this_run = result.get("this_run", {})
    return {
        "tokens_key": tokens_key(r.out_dir, r.options["input_keys"]["generate"]),
        **{k: result[k] for k in ("samples", "tokens", "bytes_per_token")},
        **{k: result[k] for k in ("aux_layers", "storage_dtype")},
        # how the folder was filled: computed by the backend, or copied from the previous extract
        "computed": this_run.get("stored"),
        "reused": this_run.get("reused", 0),
    }


def _vocab_summary(r: StageRun, result: dict[str, Any]) -> dict[str, Any]:
    return {k: result[k] for k in ("draft_vocab_size", "coverage", "loss_tokens")}


def _train_summary(r: StageRun, result: dict[str, Any]) -> dict[str, Any]:
    final = result.get("final") or {}
    return {
        "steps": result["steps"],
        "epochs": r.cfg.train.epochs,
        "samples": result.get("samples"),
        "final_top1": final.get("top1"),
        "final_loss": final.get("loss"),
        "export": DRAFT_DIR,
    }


def _verify_summary(r: StageRun, result: dict[str, Any]) -> dict[str, Any]:
    return {
        "acceptance_length": result.get("acceptance_length"),
        "acceptance_per_position": (result.get("acceptance") or {}).get("acceptance_per_position"),
        "speedup": result.get("speedup"),
        "gate": result.get("gate"),
        "promoted": result.get("promoted"),
    }


# ---------------------------------------------------------------------------
# The registry (pipeline order)


def _builtin(
    name: str, run: Callable, summary: Callable, files: dict | None = None, gpus: bool = False
) -> Stage:
    """A built-in stage: its inputs, key and code version come from :mod:`eagle3.keys`."""
    return Stage(
        name, INPUTS[name], KEY_CONFIG[name], run, summary, files or {}, CODE_VERSIONS[name], gpus
    )


STAGES: dict[str, Stage] = {
    s.name: s
    for s in (
        _builtin("generate", _run_generate, _generate_summary),
        _builtin("extract", _run_extract, _extract_summary, gpus=True),
        _builtin("vocab", _run_vocab, _vocab_summary, {"vocab": VOCAB_FILE}),
        _builtin(
            "train",
            _run_train,
            _train_summary,
            {"draft": DRAFT_DIR, "metrics": "metrics.json"},
            gpus=True,
        ),
        _builtin("verify", _run_verify, _verify_summary, {"report": "report.md"}),
    )
}
NAMES: tuple[str, ...] = tuple(STAGES)


def dependants(stages: Iterable[str]) -> set[str]:
    """The given stages and every stage downstream of them."""
    out = set(stages)
    for s in STAGES.values():  # pipeline order: an input is always met before its dependants
        if out.intersection(s.inputs):
            out.add(s.name)
    return out


def input_key(folder: Path, stage: str, for_stage: str) -> str:
    """The key ``for_stage`` takes from the ``stage`` artifact in ``folder``: generate's data key,
    extract's token key for vocab, else the artifact's key. From its artifact.json when sealed;
    for a folder written some other way (by hand, or before keyed folders), from its content."""
    from eagle3.generate.status import data_key

    folder = Path(folder)
    result = (artifacts.read_marker(folder) or {}).get("result", {})
    if stage == "generate":
        return result.get("data_key") or data_key(folder, folder.name)
    if stage == "extract" and for_stage == "vocab" and result.get("tokens_key"):
        return result["tokens_key"]
    m = artifacts.read_marker(folder)
    return m["key"] if m is not None else "unsealed-" + artifacts.digest(artifacts.listing(folder))


def input_keys(stage: str, input_dirs: dict[str, Path]) -> dict[str, str]:
    return {s: input_key(Path(d), s, stage) for s, d in input_dirs.items()}


def _tokens_config_key(cfg: PipelineConfig, data: str) -> str:
    """What :func:`eagle3.extract.storage.tokens_key` hashes, from configuration alone: the same
    samples cut the same way."""
    e = cfg.extract
    answers: dict[str, Any] = {}
    if e.dataset_answers:
        answers["dataset_answers"] = e.dataset_answers
        turns = getattr(e, "dataset_answer_turns", 1)
        if turns > 1:  # keys of first-answer runs stay as they were
            answers["dataset_answer_turns"] = turns
    cut = {"max_seq_len": e.max_seq_len, "truncation": e.truncation}
    return artifacts.digest({"data": data, **cut, **answers})


def config_keys(cfg: PipelineConfig, generate_data: str = "data") -> dict[str, str]:
    """Every stage's key from configuration alone, assuming generate's content key is
    ``generate_data`` (tests, the docs' invalidation table); the flow gets the same keys step by
    step from the real data."""
    keys = {"generate": stage_key(cfg, "generate")}
    data = artifacts.digest({"generate": keys["generate"], "samples": generate_data})
    keys["extract"] = stage_key(cfg, "extract", {"generate": data})
    tokens = _tokens_config_key(cfg, data)
    keys["vocab"] = stage_key(cfg, "vocab", {"extract": tokens})
    keys["train"] = stage_key(cfg, "train", {"extract": keys["extract"], "vocab": keys["vocab"]})
    keys["verify"] = stage_key(cfg, "verify", {"train": keys["train"]})
    return keys


def changed_stages(before: PipelineConfig, after: PipelineConfig) -> list[str]:
    """Stages whose key differs between two configurations (same generate content)."""
    a, b = config_keys(before), config_keys(after)
    return [s for s in NAMES if a[s] != b[s]]


# ---------------------------------------------------------------------------
# Running one stage


def run_stage(
    cfg: PipelineConfig,
    stage: str,
    input_dirs: dict[str, Path],
    out_dir: Path | None = None,
    **run: Any,
) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    """Key, run and seal one stage: the one path of the CLI and the Prefect tasks.

    ``input_dirs`` are the input stages' artifact folders (their keys are read from their
    ``artifact.json``); ``out_dir`` defaults to the keyed folder, which then becomes ``latest``.
    ``run`` goes to :class:`StageRun` (model, on_progress, log, options). Returns (folder, the
    library's result, the sealed summary). Under torchrun only rank 0 seals.
    """
    s = STAGES[stage]
    keys = input_keys(stage, input_dirs)
    key = stage_key(cfg, stage, keys)
    keyed_dir = cfg.paths.artifact_dir(stage, key)
    out_dir = Path(out_dir or keyed_dir)
    options = {**run.pop("options", {}), "input_keys": keys}
    r = StageRun(cfg, out_dir, {k: Path(v) for k, v in input_dirs.items()}, options=options, **run)
    rank0 = os.environ.get("RANK", "0") == "0"
    check_output_dir(out_dir)  # every input before any server starts or model loads (#39)
    check_stage_inputs(stage, r)  # ... and before the folder is created: a mistake leaves none
    # one writer per folder, for the whole run (issue #39); under torchrun rank 0 holds it
    with writer_lock(out_dir, stage) if rank0 else contextlib.nullcontext():
        if s.gpus and rank0:
            release_gpus(cfg, stage, log=r.log)  # a production unit holds the GPUs it needs
        result = s.run(r)
        if not rank0:  # torchrun: rank 0 wrote everything and seals
            return out_dir, result, {}
        summary = s.summary(r, result)
        config = stage_config(cfg, stage)
        artifacts.seal(out_dir, stage, key, s.code_version, keys, summary, config)
        if out_dir.resolve() == keyed_dir.resolve():
            artifacts.set_latest(cfg, stage, key)
    return out_dir, result, summary
