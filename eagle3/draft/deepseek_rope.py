"""RoPE of the MLA draft as vLLM's MLA layer builds it (DeepSeek flavour: interleaved pairs,
YaRN with mscale); the rotation itself (:func:`eagle3.draft.mla.apply_rope_interleaved`) is in
:mod:`eagle3.draft.mla`.

RoPE: vLLM rewrites any non-default rope type of an MLA layer to ``deepseek_yarn``
(``DeepseekScalingRotaryEmbedding``): YaRN inverse frequencies over the dr rotary dims,
cos/sin scaled by ``mscale(f, mscale) / mscale(f, mscale_all_dim)``, and the softmax scale
multiplied by ``m^2 = mscale(f, mscale_all_dim)^2`` (``mscale(f, a) = 0.1 a ln f + 1``; for
Kimi-K2.5, f = 64 and mscale_all_dim = 1, m^2 = 2.005). A scaling dict with
``attention_factor == 1.0`` is vLLM's ``deepseek_llama_scaling``: the same frequencies but no
softmax factor. Only "default" and YaRN-style scaling are accepted here.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from eagle3.draft.mla import MLADraftConfig


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def mla_rope(cfg: MLADraftConfig) -> tuple[torch.Tensor, float, float]:
    """(inverse frequencies [dr/2], cos/sin magnitude, softmax scale) as vLLM's MLA layer builds
    them (DeepseekV2MLAAttention + DeepseekScalingRotaryEmbedding)."""
    dim, base = cfg.qk_rope_head_dim, cfg.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    scale = cfg.qk_head_dim**-0.5
    if cfg.rope_type == "default":
        return 1.0 / pos_freqs, 1.0, scale
    s = cfg.rope_scaling or {}
    factor = float(s["factor"])
    orig = float(s["original_max_position_embeddings"])
    beta_fast, beta_slow = float(s.get("beta_fast", 32)), float(s.get("beta_slow", 1))

    def corr(rot: float) -> float:
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = max(math.floor(corr(beta_fast)), 0), min(math.ceil(corr(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    mscale_all_dim = float(s.get("mscale_all_dim") or 0.0)
    magnitude = yarn_get_mscale(factor, float(s.get("mscale", 1.0))) / yarn_get_mscale(
        factor, mscale_all_dim
    )
    if (
        s.get("attention_factor") != 1.0
    ):  # vLLM: deepseek_yarn; attention_factor == 1.0: deepseek_llama_scaling
        m = yarn_get_mscale(factor, mscale_all_dim)
        scale = scale * m * m
    return inv, magnitude, scale


class InterleavedRotary(nn.Module):
    """GPT-J style (interleaved pairs) RoPE, vLLM's ``is_neox_style=False``."""

    def __init__(self, cfg: MLADraftConfig) -> None:
        super().__init__()
        inv, magnitude, scale = mla_rope(cfg)
        self.register_buffer("inv_freq", inv, persistent=False)
        self.magnitude = magnitude
        self.softmax_scale = scale

    def forward(
        self, position_ids: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [B, 1, T, dr] (each frequency repeated for its pair) for
        position_ids [B, T]."""
        freqs = position_ids.to(torch.float32)[..., None] * self.inv_freq.to(position_ids.device)
        emb = freqs.repeat_interleave(2, dim=-1)
        cos = (emb.cos() * self.magnitude).to(dtype)[:, None]
        sin = (emb.sin() * self.magnitude).to(dtype)[:, None]
        return cos, sin
