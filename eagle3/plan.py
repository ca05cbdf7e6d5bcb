"""`eagle3 plan`: what a hero run would do, resolved, without running anything.

This is how a production profile (Kimi-K2.5 on 8 GPUs) is checked on a laptop or in CI:
stages, their settings, the exact server command lines and where every artifact goes.
"""

from __future__ import annotations

from typing import Any

import yaml

from eagle3 import PROJECT_ROOT
from eagle3.config import PipelineConfig
from eagle3.serving.command import format_command, vllm_command

STAGES = ["prepare-model", "serve", "generate", "extract", "vocab", "train", "verify"]
UNITS_DIR = PROJECT_ROOT / "deploy" / "systemd"


def _model_for_plan(cfg: PipelineConfig) -> tuple[str, str]:
    """(model argument, note) without converting anything."""
    if not cfg.target.is_embedded:
        return cfg.target.model, ""
    from eagle3.embedded import EmbeddedModelError, gguf_path, model_dir, prepared_path, sha256_file, spec

    try:
        m = spec(cfg.target.embedded_name)
        path = prepared_path(cfg.paths.cache_dir, m.name)
        if path is not None:
            return str(path), "prepared"
        return str(model_dir(cfg.paths.cache_dir, m, sha256_file(gguf_path(m)))), "not prepared yet"
    except EmbeddedModelError as e:
        return f"<{cfg.target.model}>", f"unavailable: {e}"


def server_plan(cfg: PipelineConfig, model: str, speculative_config: dict[str, Any] | None = None) -> dict[str, Any]:
    s = cfg.serve
    if s.backend == "external":
        return {"backend": "external", "base_url": s.base_url, "note": "checked only (/health, /v1/models)"}
    argv = vllm_command(s, model, cfg.target.served_model_name, trust_remote_code=cfg.target.trust_remote_code,
                        speculative_config=speculative_config)
    plan: dict[str, Any] = {"backend": s.backend, "ready_timeout_s": s.ready_timeout_s}
    if s.backend == "systemd":
        unit_file = UNITS_DIR / f"{s.unit}.service"
        plan["start"] = f"systemctl start {s.unit}"
        plan["unit_file"] = str(unit_file) if unit_file.exists() else f"(missing: {unit_file})"
        if speculative_config:
            plan["note"] = "speculative server: the same unit with an override of ExecStart (systemctl edit)"
    plan["command"] = format_command(argv, s.env)
    return plan


def build_plan(cfg: PipelineConfig) -> dict[str, Any]:
    model, note = _model_for_plan(cfg)
    run = cfg.paths.run_dir
    dump = lambda section: section.model_dump(mode="json")  # noqa: E731
    stages: dict[str, Any] = {}
    if cfg.target.is_embedded:
        stages["prepare-model"] = {
            "what": f"convert {cfg.target.model} (GGUF from PyPI) to safetensors, check a greedy answer",
            "artifact": model,
            "status": note,
        }
    serve_plan = server_plan(cfg, model)
    serve_plan["logs"] = str(cfg.paths.stage_dir("serve"))
    stages["serve"] = {"settings": dump(cfg.serve) | {"api_key": "***" if cfg.serve.api_key else None},
                       "server": serve_plan}
    stages["generate"] = {"settings": dump(cfg.generate), "artifact": str(cfg.paths.stage_dir("generate"))}
    stages["extract"] = {
        "settings": dump(cfg.extract),
        "aux_layers (vLLM convention: input of layer k = HF hidden_states[k])": cfg.aux_layers,
        "artifact": str(cfg.paths.stage_dir("extract")),
    }
    stages["vocab"] = {"settings": dump(cfg.vocab), "artifact": str(cfg.paths.stage_dir("vocab"))}
    stages["train"] = {"settings": dump(cfg.train), "artifact": str(cfg.paths.stage_dir("train"))}
    draft_dir = cfg.paths.stage_dir("train") / "vllm-draft"
    spec = {"method": "eagle3", "model": str(draft_dir), "num_speculative_tokens": cfg.verify.num_speculative_tokens}
    stages["verify"] = {
        "settings": dump(cfg.verify),
        "baseline server": server_plan(cfg, model),
        "speculative server": server_plan(cfg, model, speculative_config=spec),
        "artifact": str(cfg.paths.stage_dir("verify")),
    }
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
    body = yaml.safe_dump({"target": plan["target"], "stages": plan["stages"]}, sort_keys=False, width=160)
    return "\n".join(head) + body
