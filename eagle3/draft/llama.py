"""The Llama EAGLE-3 draft: Llama decoder layers (one by default) on top of the target's hidden
states.

Plain PyTorch (no transformers model classes), weight-for-weight compatible with vLLM's
``Eagle3LlamaForCausalLM`` (``vllm/model_executor/models/llama_eagle3.py``, checked against
vLLM 0.32.0). Parameter names are the checkpoint names vLLM loads (:func:`llama_weight_shapes`)::

    embed_tokens.weight                    [V, H]     frozen, copied from the target (not exported)
    fc.weight                              [H, A*Ht]  A = len(aux_layer_ids) (3), Ht = target hidden
    midlayer.input_layernorm.weight        [H]        applied to the token embeddings
    midlayer.hidden_norm.weight            [H]        applied to the (projected) hidden states
    midlayer.self_attn.q_proj.weight       [heads*hd, 2H]
    midlayer.self_attn.k_proj.weight       [kv_heads*hd, 2H]
    midlayer.self_attn.v_proj.weight       [kv_heads*hd, 2H]
    midlayer.self_attn.o_proj.weight       [H, heads*hd]
    midlayer.post_attention_layernorm.weight [H]
    midlayer.mlp.gate_proj.weight          [I, H]
    midlayer.mlp.up_proj.weight            [I, H]
    midlayer.mlp.down_proj.weight          [H, I]
    norm.weight                            [H]
    lm_head.weight                         [D, H]     D = draft vocab
    layers.{j}.*                           j = 1 .. num_layers - 1: a plain pre-norm Llama layer
                                           (input_layernorm, self_attn over H, ..., mlp)

The forward, masks and KV prefix are :mod:`eagle3.draft.common`'s; this module brings the config,
rotate-half RoPE (default, linear, llama3, yarn) and GQA attention. The KV prefix is
``(k, v)``, each ``[B, kv_heads, S, head_dim]``, keys rotated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from torch import nn

from eagle3.draft.common import (
    ConfigMethods,
    DraftModel,
    KVCache,
    attend,
    check_common_fields,
    dtype_name,
    read_config,
    rope_from_config,
    text_config,
)

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass
class DraftConfig(ConfigMethods):
    """Everything the draft's shapes and forward depend on (and what the export writes)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the TARGET vocab (embed_tokens rows, vLLM's ``vocab_size``)
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: list[int]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # HF-style rope scaling dict ({"rope_type": "llama3" | "linear" | "yarn", "factor": ..., ...})
    # or None
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    hidden_act: str = "silu"
    norm_before_residual: bool = False
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False  # the target's (informational: which tensor is its lm_head)
    # parallel drafting (P-EAGLE): the tokens one pass was trained to propose (0: sequential
    # only) and the placeholder token of its positions 1..; the draft then carries
    # ``mask_hidden`` (the placeholder's hidden state) and the export both
    parallel_depths: int = 0
    parallel_token_id: int | None = None
    # decoder layers: the first reads embeddings and hidden states (2H), the next the residual
    # stream (H), as vLLM's llama_eagle3.py builds them (P-EAGLE recipes use 2-4)
    num_layers: int = 1

    def __post_init__(self) -> None:
        check_common_fields(self, "LlamaMLP")
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.parallel_depths and self.parallel_token_id is None:
            raise ValueError("parallel_depths needs parallel_token_id (the placeholder token)")
        rope_type = self.rope_type
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope type {rope_type!r} not supported (supported: {SUPPORTED_ROPE_TYPES}); "
                "override rope_scaling=None to use plain RoPE"
            )

    @classmethod
    def from_target(
        cls,
        target_config: dict[str, Any] | str | Path,
        draft_vocab_size: int,
        aux_layer_ids: Sequence[int],
        **overrides: Any,
    ) -> DraftConfig:
        """Derive the draft's config from the target's ``config.json`` (a dict, a file or a folder).

        The draft copies the target's Llama-relevant fields (hidden size, heads, KV heads, head_dim,
        intermediate size, norm eps, RoPE incl. scaling, max positions, vocab). Multimodal wrappers
        (``text_config``, as Kimi-K2.5 has) are unwrapped. Anything can be overridden by keyword,
        e.g. ``num_key_value_heads=8`` or ``rope_scaling=None`` for a target whose own choices do
        not suit a Llama layer (DeepSeek-style targets have no ``head_dim``: hidden/heads is used).
        """
        cfg = read_config(target_config)
        text = text_config(cfg)
        hidden = int(text["hidden_size"])
        heads = int(text["num_attention_heads"])
        kv_heads = int(text.get("num_key_value_heads") or heads)
        head_dim = text.get("head_dim") or hidden // heads
        rope_theta, rope_scaling = rope_from_config(text)
        values: dict[str, Any] = dict(
            hidden_size=hidden,
            intermediate_size=int(text["intermediate_size"]),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=int(head_dim),
            vocab_size=int(text.get("vocab_size") or cfg["vocab_size"]),
            draft_vocab_size=int(draft_vocab_size),
            target_hidden_size=hidden,
            aux_layer_ids=list(aux_layer_ids),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(text.get("max_position_embeddings", 4096)),
            hidden_act=str(text.get("hidden_act", "silu")),
            tie_word_embeddings=bool(
                cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
            ),
        )
        if overrides.get("parallel_depths") and overrides.get("parallel_token_id") is None:
            overrides["parallel_token_id"] = placeholder_token(cfg)
        unknown = set(overrides) - {f.name for f in fields(cls)}
        if unknown:
            raise TypeError(f"unknown DraftConfig fields: {sorted(unknown)}")
        values.update(overrides)
        return cls(**values)


def placeholder_token(target_config: dict[str, Any]) -> int:
    """The parallel positions' token when the profile names none: the target's pad token, else
    its (first) end-of-sequence token. Any id works (its embedding is constant input, the trained
    part is ``mask_hidden``); one the target rarely reads in the middle of a text is the least
    ambiguous."""
    text = text_config(target_config)
    for key in ("pad_token_id", "eos_token_id"):
        v = text.get(key, target_config.get(key))
        if isinstance(v, list):
            v = v[0] if v else None
        if v is not None:
            return int(v)
    raise ValueError(
        "the target config has no pad_token_id or eos_token_id: set train.parallel_token_id"
    )


def config_from_export(conf: dict[str, Any]) -> DraftConfig:
    """The config of a vLLM-format export's ``config.json`` (the speculators format unwrapped to
    it)."""
    ptd = conf.get("ptd_token_id")
    return DraftConfig.from_target(
        conf,
        int(conf["draft_vocab_size"]),
        conf["eagle_config"]["eagle_aux_hidden_state_layer_ids"],
        target_hidden_size=int(conf["target_hidden_size"]),
        norm_before_residual=bool(conf.get("norm_before_residual", False)),
        parallel_depths=int(conf.get("parallel_drafting_depths") or 0) if ptd is not None else 0,
        parallel_token_id=None if ptd is None else int(ptd),
        num_layers=int(conf.get("num_hidden_layers") or 1),
    )


# ---------------------------------------------------------------------------------------------
# RoPE (rotate-half, vLLM's get_rope)
# ---------------------------------------------------------------------------------------------


def _yarn_inv_freq(cfg: DraftConfig, inv: torch.Tensor) -> tuple[torch.Tensor, float]:
    dim, base, s = cfg.head_dim, cfg.rope_theta, cfg.rope_scaling or {}
    factor = float(s["factor"])
    orig = float(s["original_max_position_embeddings"])
    beta_fast, beta_slow = float(s.get("beta_fast", 32)), float(s.get("beta_slow", 1))
    truncate = bool(s.get("truncate", True))

    def corr(rot: float) -> float:
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = corr(beta_fast), corr(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extra_mask = 1 - ramp
    new = (inv / factor) * (1 - extra_mask) + inv * extra_mask

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if s.get("attention_factor") is not None:
        mscale = float(s["attention_factor"])
    elif s.get("mscale") and s.get("mscale_all_dim"):
        mscale = get_mscale(factor, float(s["mscale"])) / get_mscale(
            factor, float(s["mscale_all_dim"])
        )
    else:
        mscale = get_mscale(factor)
    return new, mscale


def rope_inv_freq(cfg: DraftConfig) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim/2], cos/sin magnitude scale), as vLLM's get_rope builds
    them."""
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    s = cfg.rope_scaling or {}
    kind = cfg.rope_type
    if kind == "default":
        return inv, 1.0
    if kind == "linear":
        return inv / float(s["factor"]), 1.0
    if kind == "llama3":
        factor, lo, hi = (
            float(s["factor"]),
            float(s["low_freq_factor"]),
            float(s["high_freq_factor"]),
        )
        orig = float(s["original_max_position_embeddings"])
        wave = 2 * math.pi / inv
        smooth = (orig / wave - lo) / (hi - lo) if lo != hi else torch.zeros_like(inv)
        new = torch.where(
            wave < orig / hi,
            inv,
            torch.where(wave > orig / lo, inv / factor, (1 - smooth) * inv / factor + smooth * inv),
        )
        return new, 1.0
    if kind == "yarn":
        return _yarn_inv_freq(cfg, inv)
    raise ValueError(f"unsupported rope type {kind!r}")


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) RoPE, the layout of HF Llama weights and of vLLM's Llama."""

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        inv, mscale = rope_inv_freq(cfg)
        self.register_buffer("inv_freq", inv, persistent=False)
        self.mscale = mscale

    def forward(
        self, position_ids: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [B, 1, T, head_dim] for position_ids [B, T]."""
        freqs = position_ids.to(torch.float32)[..., None] * self.inv_freq.to(position_ids.device)
        emb = torch.cat([freqs, freqs], dim=-1)
        cos = (emb.cos() * self.mscale).to(dtype)[:, None]
        sin = (emb.sin() * self.mscale).to(dtype)[:, None]
        return cos, sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


# ---------------------------------------------------------------------------------------------
# Attention and the draft
# ---------------------------------------------------------------------------------------------


class Attention(nn.Module):
    """GQA, vLLM's LlamaAttention: over the 2H-wide input (embeds and hidden states
    concatenated) in the first layer, ``in_dim`` = H in the next ones."""

    def __init__(self, cfg: DraftConfig, in_dim: int | None = None) -> None:
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        in_dim = in_dim or 2 * cfg.hidden_size
        self.q_proj = nn.Linear(in_dim, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(in_dim, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(in_dim, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_mask: torch.Tensor | None,
        past_kv: KVCache | None,
    ) -> tuple[torch.Tensor, KVCache]:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out, new_kv = attend(q, k, v, attn_mask, past_kv, enable_gqa=self.n_kv != self.n_heads)
        out = out.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim)
        return self.o_proj(out), new_kv


class Eagle3Draft(DraftModel):
    """vLLM's ``Eagle3LlamaForCausalLM``: the shared draft around GQA attention and rotate-half
    RoPE."""

    attention_cls = Attention
    rotary_cls = RotaryEmbedding


def llama_weight_shapes(cfg: DraftConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint name -> shape of every trainable weight (what vLLM allocates, before its
    ``midlayer.`` -> ``layers.0.`` renaming and q/k/v, gate/up stacking)."""
    h, hd = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    return {
        "fc.weight": (h, cfg.fc_input_size),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.self_attn.q_proj.weight": (q, 2 * h),
        "midlayer.self_attn.k_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, q),
        "midlayer.post_attention_layernorm.weight": (h,),
        "midlayer.mlp.gate_proj.weight": (cfg.intermediate_size, h),
        "midlayer.mlp.up_proj.weight": (cfg.intermediate_size, h),
        "midlayer.mlp.down_proj.weight": (h, cfg.intermediate_size),
        "norm.weight": (h,),
        "lm_head.weight": (cfg.draft_vocab_size, h),
        # vLLM's mask_hidden buffer is [1, fc input]; it loads any tensor named so as view(1, -1)
        **({"mask_hidden": (1, cfg.fc_input_size)} if cfg.parallel_depths else {}),
        **{
            f"layers.{j}.{name}": shape
            for j in range(1, cfg.num_layers)
            for name, shape in {
                "input_layernorm.weight": (h,),
                "self_attn.q_proj.weight": (q, h),
                "self_attn.k_proj.weight": (kv, h),
                "self_attn.v_proj.weight": (kv, h),
                "self_attn.o_proj.weight": (h, q),
                "post_attention_layernorm.weight": (h,),
                "mlp.gate_proj.weight": (cfg.intermediate_size, h),
                "mlp.up_proj.weight": (cfg.intermediate_size, h),
                "mlp.down_proj.weight": (h, cfg.intermediate_size),
            }.items()
        },
    }


def llama_fields(cfg: DraftConfig, dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """The Llama layer config both export formats carry (transformers 4.x and 5.x RoPE
    spellings)."""
    rope_parameters = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling:
        rope_parameters = {
            **cfg.rope_scaling,
            "rope_type": cfg.rope_type,
            "rope_theta": cfg.rope_theta,
        }
    out: dict[str, Any] = {
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": rope_parameters,
        "max_position_embeddings": cfg.max_position_embeddings,
        "num_hidden_layers": cfg.num_layers,
        "vocab_size": cfg.vocab_size,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": cfg.initializer_range,
        "torch_dtype": dtype_name(dtype),  # transformers 4.x spelling
        "dtype": dtype_name(dtype),  # transformers 5.x spelling
    }
    if cfg.rope_scaling:
        out["rope_scaling"] = {**cfg.rope_scaling, "rope_type": cfg.rope_type}
    return out


__all__ = [
    "DraftConfig",
    "Eagle3Draft",
    "apply_rope",
    "config_from_export",
    "llama_fields",
    "llama_weight_shapes",
    "placeholder_token",
    "rope_inv_freq",
]
