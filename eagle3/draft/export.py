"""Write a trained draft (:mod:`eagle3.draft`) as a checkpoint vLLM serves.

Two formats, both read by vLLM 0.32's ``Eagle3LlamaForCausalLM`` (llama_eagle3.py):

``export_vllm`` (the "EAGLE-3 HF" format, as yuhuili/EAGLE3-* and SpecForge write it)
    ``config.json``: ``architectures: ["LlamaForCausalLMEagle3"]``, ``model_type: "llama"``, the
    Llama fields, ``num_hidden_layers: 1``, ``vocab_size`` = the TARGET vocab, ``draft_vocab_size``,
    ``target_hidden_size``, ``eagle_config: {"eagle_aux_hidden_state_layer_ids": [...],
    "use_aux_hidden_state": true}``. Weights: ``fc.weight``, ``midlayer.*``, ``norm.weight``,
    ``lm_head.weight``, ``d2t`` (int64), ``t2d`` (bool). Serve it with
    ``--speculative-config '{"method": "eagle3", "model": DIR, "num_speculative_tokens": k}'``.

``export_speculators`` (vllm-project/speculators)
    ``config.json`` without ``model_type`` but with ``speculators_model_type: "eagle3"``,
    ``speculators_config`` (proposal method with ``speculative_tokens``, ``verifier.name_or_path``),
    ``transformer_layer_config`` (the Llama layer config) and the eagle3 fields at the top level
    (``draft_vocab_size``, ``target_hidden_size``, ``norm_before_residual``,
    ``eagle_aux_hidden_state_layer_ids``). Weights as above but ``midlayer.`` -> ``layers.0.``.
    Either pass it as the speculative model, or ``vllm serve DIR`` and vLLM loads the verifier
    named in the config (a hub id, or a local path on the serving machine) with this draft.

What vLLM 0.32 does with these (read from its source):

- The embedding is omitted on purpose. ``load_weights`` marks ``has_own_embed_tokens`` only when
  an ``embed_tokens`` tensor is in the file; without one, the proposer's
  ``_maybe_share_embeddings`` replaces the draft's embedding by the target's (pipeline-parallel
  size 1; with PP > 1 vLLM loads the draft's separately, which this export does not support).
  ``lm_head`` IS exported (the draft's own, over the draft vocab); without it vLLM would share
  the target's full-vocab head, which does not fit ``draft_vocab_size`` rows.
- ``d2t`` is renamed to ``draft_id_to_target_id`` and used as ``target = i + d2t[i]``; ``t2d``
  is skipped by the loader (written anyway: other tools read it). vLLM only allocates the
  mapping when ``draft_vocab_size != vocab_size``; a full-vocab draft must not carry ``d2t``.
- ``norm_before_residual``: the speculators updater DEFAULTS IT TO TRUE when absent, the
  vLLM format to false; both exports write the model's value explicitly.
- The speculators updater copies only listed fields out of the top level; ``eagle_config`` is
  therefore also put inside ``transformer_layer_config`` so the draft's ``fc`` width follows
  the number of aux layers (vLLM otherwise assumes 3).

MLA drafts (:class:`eagle3.draft.mla.Eagle3MLADraft`, for DeepSeek/Kimi-family targets)
    ``export_vllm`` writes them as vLLM's ``Eagle3DeepseekV2ForCausalLM`` (deepseek_eagle3.py):
    ``architectures: ["Eagle3DeepseekV2ForCausalLM"]``, ``model_type: "deepseek_v2"`` (a
    ``deepseek_v3`` model_type is rewritten by vLLM into its MTP drafter), the MLA fields
    (``q_lora_rank``, ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``,
    written even when null: transformers' DeepseekV2Config defaults ``q_lora_rank`` to 1536), the
    dense ``intermediate_size``, RoPE (``rope_theta`` + ``rope_scaling``, 4.x and 5.x spellings),
    and the same EAGLE-3 fields and ``d2t``/``t2d`` as above. Weights: ``fc``, ``midlayer.*`` with
    ``self_attn.{q_a_proj, q_a_layernorm, q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj,
    o_proj}``, ``norm``, ``lm_head``. vLLM 0.32's loader stacks ``q_a_proj`` and
    ``kv_a_proj_with_mqa`` into ``fused_qkv_a_proj``, which only exists with a ``q_lora_rank``: a
    draft without one cannot be loaded there, so the export refuses it. The speculators format has
    no MLA layer config: ``export_speculators`` refuses MLA drafts.

What differs between the architectures (vLLM architecture name, layer fields, weight shapes,
what vLLM can load) comes from their entries in :mod:`eagle3.draft.registry`.

Files appear atomically: written into a temporary sibling folder, then renamed into place, so a
killed export never leaves a half-written draft that a later stage would serve.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from eagle3.draft.common import DraftModel, dtype_name
from eagle3.draft.llama import DraftConfig, llama_fields
from eagle3.draft.registry import DRAFTS, arch_of, arch_of_export

#: vLLM's architecture name for the MLA draft (deepseek_eagle3.py; Eagle3DeepseekV3ForCausalLM
#: is an alias).
MLA_ARCHITECTURE = DRAFTS["mla"].vllm_architecture

#: The weight names vLLM 0.32's Eagle3LlamaForCausalLM.load_weights accepts for a 1-layer Llama
#: draft (checkpoint names, before its ``midlayer.`` -> ``layers.0.`` and q/k/v, gate/up
#: stacking), without the optional embed_tokens / norm_before_fc ``input_norm`` / fc_norm.
VLLM_WEIGHT_NAMES = (
    "fc.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.post_attention_layernorm.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
)


def expected_shapes(cfg: Any) -> dict[str, tuple[int, ...]]:
    """Checkpoint name -> shape vLLM allocates for it (llama_eagle3.py + LlamaAttention/LlamaMLP;
    for an MLA config deepseek_eagle3.py + DeepseekV2MLAAttention/DeepseekV2MLP)."""
    return {
        **arch_of(cfg).weight_shapes(cfg),
        "d2t": (cfg.draft_vocab_size,),
        "t2d": (cfg.vocab_size,),
    }


def _eagle_config(cfg: Any) -> dict[str, Any]:
    return {
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        "use_aux_hidden_state": True,
    }


def vllm_config_dict(cfg: Any, dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """The export's ``config.json``: vLLM's architecture name, the layer fields, the EAGLE-3
    fields."""
    arch = arch_of(cfg)
    return {
        "architectures": [arch.vllm_architecture],
        **arch.vllm_fields(cfg, dtype),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "norm_before_residual": cfg.norm_before_residual,
        "eagle_config": _eagle_config(cfg),
        **parallel_fields(cfg),
    }


def parallel_fields(cfg: Any) -> dict[str, Any]:
    """A parallel-drafting draft's config keys: ``ptd_token_id`` (vLLM 0.32's proposer reads the
    placeholder id from it, llm_base_proposer.py) and the depths it was trained for (ours: the
    verify sweep's largest parallel k)."""
    if not getattr(cfg, "parallel_depths", 0):
        return {}
    return {"ptd_token_id": cfg.parallel_token_id, "parallel_drafting_depths": cfg.parallel_depths}


def draft_tensors(
    model: DraftModel, d2t: torch.Tensor, t2d: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> dict[str, torch.Tensor]:
    """Checkpoint tensors in vLLM-format names (``midlayer.*``), checked against the config."""
    cfg = model.config
    d2t = torch.as_tensor(d2t).to(torch.int64).reshape(-1).contiguous()
    t2d = torch.as_tensor(t2d).to(torch.bool).reshape(-1).contiguous()
    if d2t.numel() != cfg.draft_vocab_size or t2d.numel() != cfg.vocab_size:
        raise ValueError(
            f"d2t {d2t.numel()} / t2d {t2d.numel()} rows do not fit draft vocab "
            f"{cfg.draft_vocab_size} / target vocab {cfg.vocab_size}"
        )
    ids = torch.arange(d2t.numel(), dtype=torch.int64) + d2t
    if (
        bool(((ids < 0) | (ids >= cfg.vocab_size)).any())
        or int(t2d.sum()) != d2t.numel()
        or not bool(t2d[ids].all())
    ):
        raise ValueError("d2t/t2d inconsistent: i + d2t[i] must be the target ids t2d marks")
    if cfg.draft_vocab_size == cfg.vocab_size:
        # vLLM allocates no draft_id_to_target_id for a full-vocab draft: a d2t would not load.
        if not torch.equal(ids, torch.arange(cfg.vocab_size)):
            raise ValueError("a full-vocab draft must map row i to id i (vLLM ignores the mapping)")
    tensors: dict[str, torch.Tensor] = {}
    for name, t in model.trainable_state_dict().items():
        if name == "mask_hidden":  # vLLM's buffer shape
            t = t.view(1, -1)
        tensors[name] = t.detach().to("cpu", dtype).contiguous()
    if cfg.draft_vocab_size != cfg.vocab_size:
        tensors["d2t"] = d2t
    tensors["t2d"] = t2d
    shapes = expected_shapes(cfg)
    for name, t in tensors.items():
        if name not in shapes:
            raise ValueError(f"unexpected tensor {name} in the draft (vLLM would refuse it)")
        if tuple(t.shape) != shapes[name]:
            raise ValueError(f"{name}: shape {tuple(t.shape)} != expected {shapes[name]}")
    return tensors


def _atomic_dir(out_dir: Path, write) -> Path:
    """Call ``write(tmp_dir)``, then move tmp_dir to out_dir (replacing an existing export)."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.", suffix=".tmp"))
    try:
        write(tmp)
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        old = None
        if out_dir.exists():
            old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
            os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")


def _write_export(
    out_dir: Path,
    tensors: dict[str, torch.Tensor],
    config: dict[str, Any],
    metadata: dict[str, Any] | None,
) -> Path:
    """``model.safetensors`` (``metadata`` in its header) + ``config.json``, atomically."""
    header = {
        "format": "pt",
        **{k: v if isinstance(v, str) else json.dumps(v) for k, v in (metadata or {}).items()},
    }

    def write(tmp: Path) -> None:
        save_file(tensors, str(tmp / "model.safetensors"), metadata=header)
        _write_json(tmp / "config.json", config)

    return _atomic_dir(out_dir, write)


def export_vllm(
    model: DraftModel,
    cfg: Any | None,
    d2t: torch.Tensor,
    t2d: torch.Tensor,
    out_dir: str | Path,
    *,
    dtype: torch.dtype = torch.bfloat16,
    metadata: dict[str, Any] | None = None,
) -> Path:
    """Write ``config.json`` + ``model.safetensors`` in vLLM's EAGLE-3 format (see module doc).

    ``cfg`` defaults to ``model.config`` (passing another one that disagrees is an error).
    ``metadata`` (str -> JSON-able) goes into the safetensors header, e.g. training provenance.
    """
    cfg = _check_cfg(model, cfg)
    arch_of(cfg).check_export(cfg)
    tensors = draft_tensors(model, d2t, t2d, dtype)
    config = vllm_config_dict(cfg, dtype)
    return _write_export(Path(out_dir), tensors, config, metadata)


def speculators_config_dict(
    cfg: DraftConfig,
    verifier: str,
    *,
    num_speculative_tokens: int = 3,
    verifier_architectures: list[str] | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> dict[str, Any]:
    layer = {
        **llama_fields(cfg, dtype),
        "architectures": ["LlamaForCausalLM"],
        "eagle_config": _eagle_config(cfg),
    }
    # a parallel-drafting draft is speculators' "peagle": vLLM's update_peagle maps its required
    # mask_token_id to the proposer's placeholder and serves it with parallel_drafting
    algo = "peagle" if getattr(cfg, "parallel_depths", 0) else "eagle3"
    peagle = {"mask_token_id": cfg.parallel_token_id} if algo == "peagle" else {}
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": algo,
        "speculators_version": "0.3.0",
        **peagle,
        "speculators_config": {
            "algorithm": algo,
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    # peagle: the trained depths, as speculators saves them (vLLM's default k)
                    "speculative_tokens": int(
                        cfg.parallel_depths if peagle else num_speculative_tokens
                    ),
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "verifier": {
                "name_or_path": str(verifier),
                "architectures": list(verifier_architectures or ["LlamaForCausalLM"]),
            },
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "norm_before_residual": cfg.norm_before_residual,
        "norm_before_fc": False,
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        "torch_dtype": dtype_name(dtype),
    }


def export_speculators(
    model: DraftModel,
    cfg: DraftConfig | None,
    d2t: torch.Tensor,
    t2d: torch.Tensor,
    out_dir: str | Path,
    *,
    verifier: str,
    num_speculative_tokens: int = 3,
    verifier_architectures: list[str] | None = None,
    dtype: torch.dtype = torch.bfloat16,
    metadata: dict[str, Any] | None = None,
) -> Path:
    """Write the speculators format (weights under ``layers.0.*``; see module doc).

    ``verifier`` is the target's hub id or path as the SERVING machine sees it: ``vllm serve
    out_dir`` loads it from there.
    """
    cfg = _check_cfg(model, cfg)
    if not arch_of(cfg).speculators_format:
        raise ValueError(
            "the speculators format describes Llama layers only: "
            "export an MLA draft with export_vllm"
        )
    tensors = {
        ("layers.0." + k.removeprefix("midlayer.") if k.startswith("midlayer.") else k): v
        for k, v in draft_tensors(model, d2t, t2d, dtype).items()
    }
    config = speculators_config_dict(
        cfg,
        verifier,
        num_speculative_tokens=num_speculative_tokens,
        verifier_architectures=verifier_architectures,
        dtype=dtype,
    )
    return _write_export(Path(out_dir), tensors, config, metadata)


def _check_cfg(model: DraftModel, cfg: Any | None) -> Any:
    if cfg is None:
        return model.config
    if type(cfg) is not type(model.config) or cfg.to_dict() != model.config.to_dict():
        raise ValueError(
            "cfg disagrees with model.config: export the config the model was built with"
        )
    return cfg


Loaded = tuple[DraftModel, torch.Tensor | None, torch.Tensor]  # (model, d2t or None, t2d)


def load_exported(path: str | Path, *, dtype: torch.dtype = torch.float32) -> Loaded:
    """Read a vLLM-format or speculators-format export back into its draft class (an Eagle3Draft,
    or an Eagle3MLADraft for an MLA export; embedding left at its init: load it with
    ``model.load_embeddings(target_dir)``). Returns (model, d2t, t2d)."""
    path = Path(path)
    conf = json.loads((path / "config.json").read_text())
    arch = arch_of_export(conf.get("architectures") or [])
    if (
        "speculators_config" in conf and arch.speculators_format
    ):  # unwrap to the vLLM format's fields
        conf_in, layer = conf, conf["transformer_layer_config"]
        aux = (
            conf.get("eagle_aux_hidden_state_layer_ids")
            or layer["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        )
        conf = {
            **layer,
            "draft_vocab_size": conf["draft_vocab_size"],
            "target_hidden_size": conf.get("target_hidden_size") or layer["hidden_size"],
            "norm_before_residual": conf.get("norm_before_residual", True),
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux},
        }
        if conf_in.get("mask_token_id") is not None:  # peagle
            methods = conf_in["speculators_config"]["proposal_methods"]
            conf["ptd_token_id"] = conf_in["mask_token_id"]
            conf["parallel_drafting_depths"] = methods[0]["speculative_tokens"]
    return _load_tensors(path, arch.module_cls(arch.config_from_export(conf)).to(dtype), dtype)


def _load_tensors(path: Path, model: DraftModel, dtype: torch.dtype) -> Loaded:
    from safetensors.torch import load_file

    tensors = load_file(str(path / "model.safetensors"))
    tensors = {
        ("midlayer." + k.removeprefix("layers.0.") if k.startswith("layers.0.") else k): v
        for k, v in tensors.items()
    }
    d2t, t2d = tensors.pop("d2t", None), tensors.pop("t2d")
    if "mask_hidden" in tensors:  # exported as vLLM's [1, fc input]
        tensors["mask_hidden"] = tensors["mask_hidden"].reshape(-1)
    missing, unexpected = model.load_state_dict(
        {k: v.to(dtype) for k, v in tensors.items()}, strict=False
    )
    missing = [m for m in missing if not m.startswith("embed_tokens.")]
    if missing or unexpected:
        raise ValueError(f"{path}: missing {missing}, unexpected {unexpected}")
    return model, d2t, t2d


__all__ = [
    "MLA_ARCHITECTURE",
    "VLLM_WEIGHT_NAMES",
    "draft_tensors",
    "expected_shapes",
    "export_speculators",
    "export_vllm",
    "load_exported",
    "speculators_config_dict",
    "vllm_config_dict",
]
