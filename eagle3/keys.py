"""Every stage's cache key, from configuration and the keys of its inputs.

Apart from :mod:`eagle3.stages` (the stage contract, which runs the stages) so that the stages'
own modules (extract's reuse, generate's status) can key folders without importing the contract
that imports them: no import circle.

A field of a stage's own config section counts unless it is marked ``UNKEYED``
(``eagle3/config_sections.py``); a serve field counts for the stages its ``keys_stages(...)``
mark names. ``CODE_VERSIONS``: bump a stage's when a change to its code changes what it writes.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

from eagle3 import artifacts
from eagle3.config import PipelineConfig, ServeConfig


def keyed(section: BaseModel) -> dict[str, Any]:
    """A config section without its ``UNKEYED`` fields (they change how a stage runs, not what
    it writes)."""
    skip = {
        n
        for n, f in type(section).model_fields.items()
        if isinstance(f.json_schema_extra, dict) and f.json_schema_extra.get("cache_key") is False
    }
    return section.model_dump(mode="json", exclude=skip)


def serve_keyed(cfg: PipelineConfig, stage: str) -> dict[str, Any]:
    """The serve fields that key ``stage`` (those whose ``keys_stages`` mark names it)."""
    serve = cfg.serve.model_dump(mode="json")
    return {
        n: serve[n]
        for n, f in ServeConfig.model_fields.items()
        if isinstance(f.json_schema_extra, dict)
        and stage in f.json_schema_extra.get("cache_key_stages", ())
    }


def _generate_key(cfg: PipelineConfig) -> dict[str, Any]:
    g = keyed(cfg.generate)
    g["exclude_files"] = [
        {"path": str(p), "sha": artifacts.file_digest(p)} for p in cfg.generate.exclude_files
    ]
    target = artifacts.target_identity(cfg)
    return {"target": target, "generate": g, "serve": serve_keyed(cfg, "generate")}


def _extract_key(cfg: PipelineConfig) -> dict[str, Any]:
    e = keyed(cfg.extract)
    e["aux_layers"] = cfg.aux_layers  # resolved: the default depends on the target's depth
    out = {"target": artifacts.target_identity(cfg), "extract": e}
    if cfg.extract.backend == "vllm":
        out["serve"] = serve_keyed(cfg, "extract")
    return out


def _vocab_key(cfg: PipelineConfig) -> dict[str, Any]:
    return {"vocab": keyed(cfg.vocab), "target_vocab_size": cfg.target.vocab_size}


def _train_key(cfg: PipelineConfig) -> dict[str, Any]:
    t = keyed(cfg.train)
    # One optimizer step takes world size x grad_accum batches: 2 ranks with grad_accum 1 train the
    # same draft as 1 process with grad_accum 2 (DDP or FSDP alike), so that product is the key.
    # The world size is torchrun's, or the one the train stage launches.
    world = int(os.environ.get("WORLD_SIZE") or cfg.train.nproc_per_node)
    t["batches_per_step"] = world * cfg.train.grad_accum
    out = {"target": artifacts.target_identity(cfg), "train": t, "aux_layers": cfg.aux_layers}
    if cfg.extract.states == "online" and cfg.extract.backend == "vllm":
        # online, train runs the extract server: its serve settings make the states
        out["serve"] = serve_keyed(cfg, "extract")
    return out


def _verify_key(cfg: PipelineConfig) -> dict[str, Any]:
    return {
        "target": artifacts.target_identity(cfg),
        "verify": keyed(cfg.verify),
        "serve": serve_keyed(cfg, "verify"),
    }


INPUTS: dict[str, tuple[str, ...]] = {
    "generate": (),
    "extract": ("generate",),
    "vocab": ("extract",),
    "train": ("extract", "vocab"),
    "verify": ("train",),
}
KEY_CONFIG: dict[str, Callable[[PipelineConfig], dict[str, Any]]] = {
    "generate": _generate_key,
    "extract": _extract_key,
    "vocab": _vocab_key,
    "train": _train_key,
    "verify": _verify_key,
}
CODE_VERSIONS: dict[str, str] = {name: "1" for name in INPUTS}


def stage_config(cfg: PipelineConfig, stage: str) -> dict[str, Any]:
    """The configuration ``stage``'s output depends on."""
    if stage not in KEY_CONFIG:
        raise ValueError(f"unknown stage {stage!r}; stages: {', '.join(KEY_CONFIG)}")
    return KEY_CONFIG[stage](cfg)


def key_of(
    stage: str,
    code: str,
    config: dict[str, Any],
    need: tuple[str, ...],
    inputs: dict[str, str] | None,
) -> str:
    """hash(stage, code version, the stage's configuration, the keys of its inputs)."""
    inputs = dict(inputs or {})
    missing = [i for i in need if i not in inputs]
    if missing:
        raise ValueError(f"stage {stage}: input keys missing for {missing}")
    return artifacts.digest(
        {"stage": stage, "code": code, "config": config, "inputs": {i: inputs[i] for i in need}}
    )


def stage_key(cfg: PipelineConfig, stage: str, inputs: dict[str, str] | None = None) -> str:
    """A built-in stage's key (:func:`eagle3.stages.stage_key` also keys registered ones)."""
    config = stage_config(cfg, stage)
    return key_of(stage, CODE_VERSIONS[stage], config, INPUTS[stage], inputs)


def extract_settings_key(cfg: PipelineConfig) -> str:
    """The extract stage key without its input: equal keys store equal states for equal tokens."""
    code = CODE_VERSIONS["extract"]
    return artifacts.digest(
        {"stage": "extract", "code": code, "config": stage_config(cfg, "extract")}
    )
