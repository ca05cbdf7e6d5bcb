"""The MLA-style EAGLE-3 draft: one DeepSeek decoder layer (MLA attention, dense MLP).

Plain PyTorch, weight-for-weight compatible with vLLM's ``Eagle3DeepseekV2ForCausalLM``
(``vllm/model_executor/models/deepseek_eagle3.py``, which builds ``DeepseekV2MLAAttention`` with
``input_size = 2 * hidden_size`` and a ``DeepseekV2MLP``; checked against vLLM 0.32.0). This is
the draft vLLM's Kimi-K2.5 recipe serves; on vLLM CPU it is also the only EAGLE-3 draft an MLA
target accepts (docs/train.md, "Draft architectures"). Checkpoint names
(:func:`mla_weight_shapes`)::

    embed_tokens.weight                          [V, H]       frozen, from the target, not exported
    fc.weight                                    [H, A*Ht]
    midlayer.input_layernorm.weight              [H]          applied to the token embeddings
    midlayer.hidden_norm.weight                  [H]          applied to the projected hidden states
    midlayer.self_attn.q_a_proj.weight           [Rq, 2H]     (q_lora_rank Rq)
    midlayer.self_attn.q_a_layernorm.weight      [Rq]
    midlayer.self_attn.q_b_proj.weight           [n*(dn+dr), Rq]
    midlayer.self_attn.kv_a_proj_with_mqa.weight [Rkv+dr, 2H]
    midlayer.self_attn.kv_a_layernorm.weight     [Rkv]
    midlayer.self_attn.kv_b_proj.weight          [n*(dn+dv), Rkv]
    midlayer.self_attn.o_proj.weight             [H, n*dv]
    midlayer.post_attention_layernorm.weight     [H]
    midlayer.mlp.{gate,up}_proj.weight           [I, H]
    midlayer.mlp.down_proj.weight                [H, I]
    norm.weight                                  [H]
    lm_head.weight                               [D, H]

(n heads, dn = qk_nope_head_dim, dr = qk_rope_head_dim, dv = v_head_dim, Rkv = kv_lora_rank;
without a q_lora_rank one q_proj [n*(dn+dr), 2H] replaces q_a_proj, q_a_layernorm, q_b_proj.)

The layer is vLLM's ``DeepseekV2Eagle3DecoderLayer`` with ``layer_idx == 0``, step for step; the
residual handling, the embeds-first concatenation and the final norm are the shared ones
(:mod:`eagle3.draft.common`), only the attention differs. The attention is vLLM's
``MultiHeadLatentAttentionWrapper`` (``vllm/model_executor/layers/mla.py``) written out
unabsorbed (the same maths as its prefill path and as transformers' ``DeepseekV3Attention``)::

    q          = q_b_proj(q_a_layernorm(q_a_proj(x)))      -> [T, n, dn + dr]   (x is 2H wide)
    kv_c, k_pe = split(kv_a_proj_with_mqa(x), [Rkv, dr])   (k_pe: ONE head shared by all heads)
    k_nope, v  = split(kv_b_proj(kv_a_layernorm(kv_c)) -> [T, n, dn + dv], [dn, dv])
    q_pe, k_pe = RoPE(q[..., dn:]), RoPE(k_pe)             interleaved pairs (is_neox_style=False)
    k          = cat(k_nope, k_pe broadcast over heads)
    attn       = softmax(q k^T * scale) v,  scale = (dn + dr)^-0.5 * m^2
    out        = o_proj(attn)

RoPE (DeepSeek YaRN, interleaved pairs): :mod:`eagle3.draft.deepseek_rope`.

Forward interface, attention masks and KV prefixes are the shared draft's, so the trainer's TTT
unroll runs unchanged. The KV prefix holds the expanded per-head keys and values:
``past_kv = (k [B, n, S, dn + dr] (RoPE applied), v [B, n, S, dv])``.
"""

from __future__ import annotations

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
    RMSNorm,
    attend,
    check_common_fields,
    dtype_name,
    read_config,
    rope_from_config,
    text_config,
)
from eagle3.draft.deepseek_rope import InterleavedRotary, mla_rope, yarn_get_mscale

# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------

MLA_ROPE_TYPES = ("default", "yarn", "deepseek_yarn")
#: The target config fields an MLA draft copies (all DeepSeek-V2/V3 and Kimi-K2 configs have them).
MLA_FIELDS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


@dataclass
class MLADraftConfig(ConfigMethods):
    """Shapes and forward settings of the MLA draft (what the export writes)."""

    hidden_size: int
    intermediate_size: int  # the dense MLP (DeepSeek: the target's dense `intermediate_size`)
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    vocab_size: int  # the TARGET vocab
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: list[int]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    hidden_act: str = "silu"
    norm_before_residual: bool = False
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False  # the target's (informational)

    def __post_init__(self) -> None:
        check_common_fields(self, "DeepseekV2MLP")
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim <= 0:
            raise ValueError(
                f"qk_rope_head_dim must be even and positive, got {self.qk_rope_head_dim}"
            )
        if self.q_lora_rank is not None:
            self.q_lora_rank = int(self.q_lora_rank)
        if self.rope_type not in MLA_ROPE_TYPES:
            raise ValueError(
                f"rope type {self.rope_type!r}: vLLM's MLA layer treats every non-default type as "
                f"DeepSeek YaRN, so only {MLA_ROPE_TYPES} are accepted; override rope_scaling=None "
                "for plain RoPE"
            )
        if self.rope_type != "default":
            missing = [
                k
                for k in ("factor", "original_max_position_embeddings")
                if k not in (self.rope_scaling or {})
            ]
            if missing:
                raise ValueError(f"YaRN rope_scaling needs {missing}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @classmethod
    def from_target(
        cls,
        target_config: dict[str, Any] | str | Path,
        draft_vocab_size: int,
        aux_layer_ids: Sequence[int],
        **overrides: Any,
    ) -> MLADraftConfig:
        """Derive the MLA draft's config from a DeepSeek-V2/V3 or Kimi-K2(.5) target config.

        Copies the target's MLA geometry (heads, q_lora_rank, kv_lora_rank, nope/rope/v head dims),
        its dense ``intermediate_size`` (DeepSeek's first dense layers; the MoE width
        ``moe_intermediate_size`` is not used), norm eps, RoPE incl. YaRN and vocab. Multimodal
        wrappers (``text_config``) are unwrapped. Any field can be overridden by keyword.
        """
        cfg = read_config(target_config)
        text = text_config(cfg)
        if "num_key_value_heads" in overrides:
            raise TypeError(
                "num_key_value_heads does not apply to the MLA draft (every head reads the shared "
                "latent); drop train.draft_num_key_value_heads or use train.draft_arch: llama"
            )
        unknown = set(overrides) - {f.name for f in fields(cls)}
        if unknown:
            raise TypeError(f"unknown MLADraftConfig fields: {sorted(unknown)}")
        missing = [k for k in MLA_FIELDS if text.get(k) is None and k not in overrides]
        if missing:
            raise ValueError(
                f"the target config has no MLA fields {missing} "
                "(not a DeepSeek/Kimi-style model?): use the Llama draft "
                "(train.draft_arch: llama) or give them as overrides"
            )
        hidden = int(text["hidden_size"])
        rope_theta, rope_scaling = rope_from_config(text)
        values: dict[str, Any] = dict(
            hidden_size=hidden,
            intermediate_size=int(text["intermediate_size"]),
            num_attention_heads=int(text["num_attention_heads"]),
            q_lora_rank=text.get("q_lora_rank"),
            kv_lora_rank=text.get("kv_lora_rank"),
            qk_nope_head_dim=text.get("qk_nope_head_dim"),
            qk_rope_head_dim=text.get("qk_rope_head_dim"),
            v_head_dim=text.get("v_head_dim"),
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
        values.update(overrides)
        for k in MLA_FIELDS:
            values[k] = int(values[k])
        return cls(**values)


# ---------------------------------------------------------------------------------------------
# RoPE (DeepSeek flavour: interleaved pairs; frequencies and YaRN in eagle3.draft.deepseek_rope).
# The rotation stays here: tests/test_mla_draft.py swaps _rotate_gptj for a negative control.
# ---------------------------------------------------------------------------------------------


def _rotate_gptj(x: torch.Tensor) -> torch.Tensor:
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_gptj(x) * sin


# ---------------------------------------------------------------------------------------------
# Layers
# ---------------------------------------------------------------------------------------------


class MLAAttention(nn.Module):
    """Multi-head latent attention over a 2H-wide input (embeds and hidden states concatenated)."""

    def __init__(self, cfg: MLADraftConfig) -> None:
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.q_lora_rank = cfg.q_lora_rank
        self.kv_lora_rank = cfg.kv_lora_rank
        self.nope, self.rope, self.v_dim = (
            cfg.qk_nope_head_dim,
            cfg.qk_rope_head_dim,
            cfg.v_head_dim,
        )
        qk = self.nope + self.rope
        in_dim = 2 * cfg.hidden_size
        if cfg.q_lora_rank is not None:
            self.q_a_proj = nn.Linear(in_dim, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, self.n_heads * qk, bias=False)
        else:
            self.q_proj = nn.Linear(in_dim, self.n_heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(in_dim, cfg.kv_lora_rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(
            cfg.kv_lora_rank, self.n_heads * (self.nope + self.v_dim), bias=False
        )
        self.o_proj = nn.Linear(self.n_heads * self.v_dim, cfg.hidden_size, bias=False)
        self.softmax_scale = mla_rope(cfg)[2]

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_mask: torch.Tensor | None,
        past_kv: KVCache | None,
    ) -> tuple[torch.Tensor, KVCache]:
        b, t, _ = x.shape
        n = self.n_heads
        if self.q_lora_rank is not None:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q = q.view(b, t, n, self.nope + self.rope).transpose(1, 2)  # [B, n, T, dn+dr]
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        kv_c, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)
        kv = (
            self.kv_b_proj(self.kv_a_layernorm(kv_c))
            .view(b, t, n, self.nope + self.v_dim)
            .transpose(1, 2)
        )
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        q_pe = apply_rope_interleaved(q_pe, cos, sin)
        k_pe = apply_rope_interleaved(k_pe.unsqueeze(1), cos, sin)  # [B, 1, T, dr]: one shared head
        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(b, n, t, self.rope)], dim=-1)
        out, new_kv = attend(q, k, v, attn_mask, past_kv, scale=self.softmax_scale)
        out = out.transpose(1, 2).reshape(b, t, n * self.v_dim)
        return self.o_proj(out), new_kv


class Eagle3MLADraft(DraftModel):
    """vLLM's ``Eagle3DeepseekV2ForCausalLM``: the shared draft
    (:class:`eagle3.draft.common.DraftModel`: forward, project, load_embeddings,
    trainable_state_dict, config) around MLA attention and interleaved RoPE."""

    attention_cls = MLAAttention
    rotary_cls = InterleavedRotary


def mla_weight_shapes(cfg: MLADraftConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint name -> shape of every trainable weight (what vLLM allocates, before its
    q_a_proj/kv_a_proj_with_mqa -> fused_qkv_a_proj and gate/up stacking)."""
    h, n, i = cfg.hidden_size, cfg.num_attention_heads, cfg.intermediate_size
    a = "midlayer.self_attn."
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, cfg.fc_input_size),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.hidden_norm.weight": (h,),
    }
    if cfg.q_lora_rank is not None:
        shapes[a + "q_a_proj.weight"] = (cfg.q_lora_rank, 2 * h)
        shapes[a + "q_a_layernorm.weight"] = (cfg.q_lora_rank,)
        shapes[a + "q_b_proj.weight"] = (n * cfg.qk_head_dim, cfg.q_lora_rank)
    else:
        shapes[a + "q_proj.weight"] = (n * cfg.qk_head_dim, 2 * h)
    shapes.update(
        {
            a + "kv_a_proj_with_mqa.weight": (cfg.kv_lora_rank + cfg.qk_rope_head_dim, 2 * h),
            a + "kv_a_layernorm.weight": (cfg.kv_lora_rank,),
            a + "kv_b_proj.weight": (n * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
            a + "o_proj.weight": (h, n * cfg.v_head_dim),
            "midlayer.post_attention_layernorm.weight": (h,),
            "midlayer.mlp.gate_proj.weight": (i, h),
            "midlayer.mlp.up_proj.weight": (i, h),
            "midlayer.mlp.down_proj.weight": (h, i),
            "norm.weight": (h,),
            "lm_head.weight": (cfg.draft_vocab_size, h),
        }
    )
    return shapes


def config_from_export(conf: dict[str, Any]) -> MLADraftConfig:
    """The config of an MLA export's ``config.json``."""
    return MLADraftConfig.from_target(
        conf,
        int(conf["draft_vocab_size"]),
        conf["eagle_config"]["eagle_aux_hidden_state_layer_ids"],
        target_hidden_size=int(conf["target_hidden_size"]),
        q_lora_rank=conf.get("q_lora_rank"),
        norm_before_residual=bool(conf.get("norm_before_residual", False)),
        initializer_range=float(conf.get("initializer_range", 0.02)),
    )


def check_vllm_loadable(cfg: MLADraftConfig) -> None:
    """vLLM 0.32's loader stacks ``q_a_proj`` and ``kv_a_proj_with_mqa`` into ``fused_qkv_a_proj``,
    which exists only with a ``q_lora_rank``: refuse to export a draft vLLM cannot load."""
    if cfg.q_lora_rank is None:
        raise ValueError(
            "an MLA draft without q_lora_rank cannot be loaded by vLLM 0.32 (its loader stacks "
            "kv_a_proj_with_mqa into fused_qkv_a_proj, which exists only with a q_lora_rank)"
        )


def mla_fields(cfg: MLADraftConfig, dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """The DeepSeek-V2 layer config of an MLA draft (what transformers' DeepseekV2Config and
    vLLM's DeepseekV2MLAAttention read)."""
    rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling:
        rope_parameters = {
            **cfg.rope_scaling,
            "rope_type": cfg.rope_type,
            "rope_theta": cfg.rope_theta,
        }
    out: dict[str, Any] = {
        "model_type": "deepseek_v2",  # not deepseek_v3: vLLM turns that into its MTP drafter
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_attention_heads,
        "q_lora_rank": cfg.q_lora_rank,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": rope_parameters,
        "max_position_embeddings": cfg.max_position_embeddings,
        "num_hidden_layers": 1,
        # informational: the draft layer is dense (vLLM always builds an MLP)
        "first_k_dense_replace": 1,
        "vocab_size": cfg.vocab_size,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": cfg.initializer_range,
        "torch_dtype": dtype_name(dtype),
        "dtype": dtype_name(dtype),
    }
    if cfg.rope_scaling:
        out["rope_scaling"] = {**cfg.rope_scaling, "rope_type": cfg.rope_type}
    return out


__all__ = [
    "Eagle3MLADraft",
    "InterleavedRotary",
    "MLADraftConfig",
    "MLAAttention",
    "apply_rope_interleaved",
    "check_vllm_loadable",
    "config_from_export",
    "mla_fields",
    "mla_rope",
    "mla_weight_shapes",
    "yarn_get_mscale",
]
