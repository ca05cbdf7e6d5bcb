"""The EAGLE-3 draft: one Llama decoder layer on top of the target's hidden states.

Plain PyTorch (no transformers model classes), weight-for-weight compatible with vLLM's
``Eagle3LlamaForCausalLM`` (``vllm/model_executor/models/llama_eagle3.py``, checked against
vLLM 0.32.0). Parameter names are the checkpoint names vLLM loads (see :mod:`eagle3.export`)::

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

The forward is vLLM's, step for step (``LlamaDecoderLayer.forward`` with ``layer_idx == 0`` and
``LlamaModel.forward`` of llama_eagle3.py)::

    hidden   = fc(aux)                       # only for target states; later steps pass H-wide states
    residual = hidden                        # norm_before_residual=False (vLLM's default for this format)
    x        = cat([input_layernorm(embed(ids)), hidden_norm(hidden)], -1)   # EMBEDS FIRST, 2H
    residual = self_attn(x) + residual       # RoPE (neox / rotate-half), GQA, causal
    out      = mlp(post_attention_layernorm(residual)) + residual
    logits   = lm_head(norm(out))            # [.., D]; target id of row i is i + d2t[i]
    return out, logits                       # ``out`` (pre-norm) is what vLLM feeds the next draft step

Alignment (as vLLM's proposer does it): the hidden state at position t is paired with the token
at position t+1 (the token the target emitted after it), and the logits at t predict token t+2.
The trainer shifts the ids; this module only pairs what it is given position by position.

Attention masks and KV prefixes (for the training-time test, TTT):

- ``attn_mask=None`` and no ``past_kv``: causal over the T positions.
- ``past_kv=(k, v)`` (each ``[B, kv_heads, S, head_dim]``, keys already rotated, as returned by
  ``forward(..., use_cache=True)``): the new keys/values are appended after the prefix. With
  ``attn_mask=None`` query i attends to the whole prefix and to new positions ``<= i``.
- ``attn_mask``: explicit, broadcastable to ``[B, heads, T, S + T]`` (S = prefix length, 0
  without a prefix). Boolean: True = may attend (torch SDPA convention). Floating point:
  additive (0 = attend, -inf = masked). It replaces the causal default entirely.

EAGLE-3's TTT unroll: step 0 runs on the target states with the causal default and
``use_cache=True``; step k>0 runs on step k-1's returned ``out`` (H wide, not through ``fc``)
with the ids shifted one further, ``past_kv`` = the keys/values of steps 0..k-1 concatenated
along the sequence axis, and a boolean mask ``[T, k*T + T]`` that is causal over step 0's block
and the diagonal (position t only) over each later block, including the current one.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class ConfigMethods:
    """What both draft configs (this module's and :mod:`eagle3.model_mla`'s dataclasses) derive
    the same way from their fields ``rope_scaling``, ``target_hidden_size`` and ``aux_layer_ids``."""

    @property
    def rope_type(self) -> str:
        if not self.rope_scaling:
            return "default"
        return str(self.rope_scaling.get("rope_type") or self.rope_scaling.get("type") or "default")

    @property
    def fc_input_size(self) -> int:
        return self.target_hidden_size * len(self.aux_layer_ids)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]):
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


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
    # HF-style rope scaling dict ({"rope_type": "llama3" | "linear" | "yarn", "factor": ..., ...}) or None
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    hidden_act: str = "silu"
    norm_before_residual: bool = False
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False  # the target's (informational: which tensor is its lm_head)

    def __post_init__(self) -> None:
        self.aux_layer_ids = [int(i) for i in self.aux_layer_ids]
        if len(set(self.aux_layer_ids)) != len(self.aux_layer_ids):
            raise ValueError(f"aux_layer_ids must be distinct, got {self.aux_layer_ids}")
        if not self.aux_layer_ids:
            raise ValueError("aux_layer_ids must not be empty")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} not in [1, {self.vocab_size}]")
        if self.hidden_act != "silu":
            raise ValueError(f"only silu MLPs are supported (vLLM's LlamaMLP), got {self.hidden_act}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        rope_type = self.rope_type
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope type {rope_type!r} not supported (supported: {SUPPORTED_ROPE_TYPES}); "
                             "override rope_scaling=None to use plain RoPE")


    @classmethod
    def from_target(
        cls,
        target_config: dict[str, Any] | str | Path,
        draft_vocab_size: int,
        aux_layer_ids: Sequence[int],
        **overrides: Any,
    ) -> "DraftConfig":
        """Derive the draft's config from the target's ``config.json`` (a dict, a file or a folder).

        The draft copies the target's Llama-relevant fields (hidden size, heads, KV heads, head_dim,
        intermediate size, norm eps, RoPE incl. scaling, max positions, vocab). Multimodal wrappers
        (``text_config``, as Kimi-K2.5 has) are unwrapped. Anything can be overridden by keyword,
        e.g. ``num_key_value_heads=8`` or ``rope_scaling=None`` for a target whose own choices do
        not suit a Llama layer (DeepSeek-style targets have no ``head_dim``: hidden/heads is used).
        """
        cfg = _read_config(target_config)
        text = cfg.get("text_config") or cfg.get("language_config") or cfg
        if not isinstance(text, dict):
            text = cfg
        hidden = int(text["hidden_size"])
        heads = int(text["num_attention_heads"])
        kv_heads = int(text.get("num_key_value_heads") or heads)
        head_dim = text.get("head_dim") or hidden // heads
        rope_theta, rope_scaling = _rope_from_config(text)
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
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        )
        unknown = set(overrides) - {f.name for f in fields(cls)}
        if unknown:
            raise TypeError(f"unknown DraftConfig fields: {sorted(unknown)}")
        values.update(overrides)
        return cls(**values)


def _read_config(target_config: dict[str, Any] | str | Path) -> dict[str, Any]:
    if isinstance(target_config, dict):
        return target_config
    p = Path(target_config)
    if p.is_dir():
        p = p / "config.json"
    return json.loads(p.read_text())


def _rope_from_config(c: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None) from transformers 4.x (rope_theta + rope_scaling) or
    5.x (rope_parameters) style configs."""
    params = c.get("rope_parameters")
    if isinstance(params, dict) and params and not any(isinstance(v, dict) for v in params.values()):
        theta = float(params.get("rope_theta", c.get("rope_theta", 10000.0)))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(c.get("rope_theta", 10000.0))
        scaling = dict(c.get("rope_scaling") or {})
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    scaling.pop("type", None)
    if scaling.get("rope_type", "default") == "default":
        return theta, None
    return theta, scaling


# ---------------------------------------------------------------------------------------------
# Reading single tensors out of the target's checkpoint
# ---------------------------------------------------------------------------------------------

#: Where Llama-style and multimodal-wrapped (Kimi-K2.5: ``language_model.``) checkpoints keep them.
EMBED_NAMES = (
    "model.embed_tokens.weight",
    "language_model.model.embed_tokens.weight",
    "model.language_model.embed_tokens.weight",
    "embed_tokens.weight",
)
LM_HEAD_NAMES = (
    "lm_head.weight",
    "language_model.lm_head.weight",
    "model.lm_head.weight",
)


def checkpoint_dir(model: str | Path) -> Path:
    """The local folder of the target's checkpoint: ``model`` itself, or a hub id's snapshot in the
    local Hugging Face cache (where vLLM put it when it first served the target, with the same
    ``HF_HOME``). Never downloads: the stages that read the checkpoint (train reads the embedding,
    final norm and lm_head) must not fetch a 1T-parameter model as a side effect.

    Raises:
        FileNotFoundError: neither a folder nor a cached snapshot (the message says what to set).
    """
    path = Path(model)
    if path.is_dir():
        return path
    name = str(model)
    if not path.is_absolute() and name.count("/") == 1 and not name.startswith("."):
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError

        try:
            return Path(snapshot_download(name, local_files_only=True))
        except LocalEntryNotFoundError:
            raise FileNotFoundError(
                f"target {name}: not a local folder, and not in the local Hugging Face cache "
                f"({constants.HF_HUB_CACHE}). The serve stage's vLLM downloads it there on its first start "
                "(same HF_HOME); or set target.model to the checkpoint's folder") from None
    raise FileNotFoundError(f"target {name}: no such folder")


def _checkpoint_map(model_dir: Path) -> dict[str, str]:
    """tensor name -> file name (relative to model_dir), from the index or the single file."""
    from safetensors import safe_open

    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return dict(json.loads(index.read_text())["weight_map"])
    single = model_dir / "model.safetensors"
    if single.is_file():
        with safe_open(str(single), framework="pt") as f:
            return {k: single.name for k in f.keys()}
    raise FileNotFoundError(f"{model_dir}: neither model.safetensors.index.json nor model.safetensors")


def load_target_tensor(model_dir: str | Path, names: str | Sequence[str]) -> torch.Tensor:
    """One tensor from the target's safetensors checkpoint, without loading the target.

    ``names`` is a name or candidate names tried in order; the first present is returned.
    With ``model.safetensors.index.json`` only the shard that holds the tensor is opened (and
    only that tensor read: safetensors memory-maps), so a 1T-parameter checkpoint costs one
    tensor's bytes. Without an index, ``model.safetensors`` is read the same way.

    Raises:
        KeyError: none of the names is in the checkpoint (the message lists what was tried).
    """
    from safetensors import safe_open

    model_dir = Path(model_dir)
    candidates = [names] if isinstance(names, str) else list(names)
    weight_map = _checkpoint_map(model_dir)
    for name in candidates:
        if name in weight_map:
            with safe_open(str(model_dir / weight_map[name]), framework="pt") as f:
                return f.get_tensor(name)
    raise KeyError(f"{model_dir}: none of {candidates} in the checkpoint")


def has_target_tensor(model_dir: str | Path, names: str | Sequence[str]) -> str | None:
    """The first of ``names`` present in the checkpoint, or None (reads only the index/header)."""
    weight_map = _checkpoint_map(Path(model_dir))
    for name in [names] if isinstance(names, str) else names:
        if name in weight_map:
            return name
    return None


def load_target_embeddings(model_dir: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(embed_tokens [V, H], lm_head [V, H]) of the target. Tied embeddings (no lm_head tensor,
    or ``tie_word_embeddings``) give the embedding for both (the same tensor object)."""
    model_dir = Path(model_dir)
    embed = load_target_tensor(model_dir, EMBED_NAMES)
    cfg_path = model_dir / "config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    tied = bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
    head_name = None if tied else has_target_tensor(model_dir, LM_HEAD_NAMES)
    head = embed if head_name is None else load_target_tensor(model_dir, head_name)
    return embed, head


# ---------------------------------------------------------------------------------------------
# Layers
# ---------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """Llama RMSNorm, computed in float32 (as vLLM and HF do), cast back, then scaled."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


def rope_inv_freq(cfg: DraftConfig) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim/2], cos/sin magnitude scale), as vLLM's get_rope builds them."""
    dim = cfg.head_dim
    base = cfg.rope_theta
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    s = cfg.rope_scaling or {}
    kind = cfg.rope_type
    if kind == "default":
        return inv, 1.0
    if kind == "linear":
        return inv / float(s["factor"]), 1.0
    if kind == "llama3":
        factor, lo, hi = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
        orig = float(s["original_max_position_embeddings"])
        wave = 2 * math.pi / inv
        smooth = (orig / wave - lo) / (hi - lo) if lo != hi else torch.zeros_like(inv)
        new = torch.where(
            wave < orig / hi, inv,
            torch.where(wave > orig / lo, inv / factor, (1 - smooth) * inv / factor + smooth * inv),
        )
        return new, 1.0
    if kind == "yarn":
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
            mscale = get_mscale(factor, float(s["mscale"])) / get_mscale(factor, float(s["mscale_all_dim"]))
        else:
            mscale = get_mscale(factor)
        return new, mscale
    raise ValueError(f"unsupported rope type {kind!r}")


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) RoPE, the layout of HF Llama weights and of vLLM's Llama."""

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        inv, mscale = rope_inv_freq(cfg)
        self.register_buffer("inv_freq", inv, persistent=False)
        self.mscale = mscale

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
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


KVCache = tuple[torch.Tensor, torch.Tensor]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None,
           past_kv: KVCache | None, **sdpa: Any) -> tuple[torch.Tensor, KVCache]:
    """SDPA over an optional KV prefix, with the mask convention of the module docstring.

    ``q`` [B, heads, T, d], ``k``/``v`` this call's keys and values (dim 2 = positions). Returns
    (attention output [B, heads, T, dv], this call's (k, v) without the prefix). Shared by the
    Llama and the MLA attention."""
    t = q.shape[2]
    new_kv = (k, v)
    if past_kv is not None:
        k = torch.cat([past_kv[0], k], dim=2)
        v = torch.cat([past_kv[1], v], dim=2)
    s_past = k.shape[2] - t
    is_causal = False
    if attn_mask is None:
        if s_past == 0:
            is_causal = True
        else:  # causal with an offset: everything in the prefix, new positions <= i
            attn_mask = torch.ones(t, s_past + t, dtype=torch.bool, device=q.device).tril(s_past)
    elif attn_mask.shape[-1] != s_past + t:
        raise ValueError(f"attn_mask last dim {attn_mask.shape[-1]} != prefix {s_past} + {t}")
    if attn_mask is not None and attn_mask.is_floating_point():
        attn_mask = attn_mask.to(q.dtype)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **sdpa)
    return out, new_kv


class Attention(nn.Module):
    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        in_dim = 2 * cfg.hidden_size
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


class MLP(nn.Module):
    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    """vLLM's Eagle3 ``LlamaDecoderLayer`` with ``layer_idx == 0``; returns (residual stream, kv)."""

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.norm_before_residual = cfg.norm_before_residual
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        past_kv: KVCache | None = None,
    ) -> tuple[torch.Tensor, KVCache]:
        e = self.input_layernorm(embeds)
        if self.norm_before_residual:
            h = self.hidden_norm(hidden)
            residual = h
        else:
            residual = hidden
            h = self.hidden_norm(hidden)
        x = torch.cat([e, h], dim=-1)  # embeddings first, as vLLM concatenates
        a, kv = self.self_attn(x, cos, sin, attn_mask, past_kv)
        residual = a + residual
        out = self.mlp(self.post_attention_layernorm(residual)) + residual
        return out, kv


# ---------------------------------------------------------------------------------------------
# The draft
# ---------------------------------------------------------------------------------------------


class Eagle3Draft(nn.Module):
    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)  # frozen: copied from the target
        self.fc = nn.Linear(cfg.fc_input_size, cfg.hidden_size, bias=False)
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Llama init: Linear weights N(0, initializer_range), norms 1. Embeddings untouched."""
        std = self.config.initializer_range
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, mean=0.0, std=std)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)

    # -- target weights -----------------------------------------------------------------------

    def load_embeddings(self, model_dir: str | Path) -> None:
        """Copy the target's input embedding (frozen), reading only that tensor from disk."""
        embed = load_target_tensor(model_dir, EMBED_NAMES)
        if tuple(embed.shape) != tuple(self.embed_tokens.weight.shape):
            raise ValueError(f"target embedding {tuple(embed.shape)} != draft {tuple(self.embed_tokens.weight.shape)}")
        with torch.no_grad():
            self.embed_tokens.weight.copy_(embed.to(self.embed_tokens.weight.dtype))

    def init_lm_head_from_target(self, model_dir: str | Path, d2t: torch.Tensor) -> None:
        """Optional warm start: lm_head rows = the target's lm_head rows of the draft's ids
        (tied targets: embedding rows). Needs draft hidden == target hidden."""
        _, head = load_target_embeddings(model_dir)
        ids = torch.arange(d2t.numel(), dtype=torch.int64) + d2t.to(torch.int64)
        if head.shape[1] != self.config.hidden_size or ids.numel() != self.config.draft_vocab_size:
            raise ValueError("target lm_head / d2t do not fit this draft")
        with torch.no_grad():
            self.lm_head.weight.copy_(head[ids].to(self.lm_head.weight.dtype))

    # -- forward ------------------------------------------------------------------------------

    def project(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """fc: [.., A*Ht] target states -> [.., H] (vLLM's ``combine_hidden_states``)."""
        return self.fc(aux_hidden)

    def forward(
        self,
        input_ids: torch.Tensor,
        hidden_states: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        past_kv: KVCache | None = None,
        use_cache: bool = False,
        inputs_embeds: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, KVCache]:
        """One draft step.

        Args:
            input_ids: [B, T] token ids (the NEXT tokens relative to ``hidden_states``).
            hidden_states: [B, T, A*Ht] concatenated aux target states (projected by ``fc``) or
                [B, T, H] already-projected states (a previous step's returned ``out``). Which
                one is decided by the last dim (``fc_input_size`` vs ``hidden_size``).
            position_ids: [B, T] or [T]; default ``past_len + arange(T)``.
            attn_mask: see the module docstring (None: causal, offset by any prefix).
            past_kv: (k, v) prefix, each [B, kv_heads, S, head_dim], keys rotated.
            use_cache: also return this call's (k, v) (without the prefix).
            inputs_embeds: [B, T, H] instead of embedding ``input_ids``.

        Returns:
            ``(out [B, T, H], logits [B, T, D])`` (+ ``(k, v)`` with ``use_cache``). ``out`` is
            the pre-norm residual stream: the hidden state of the next unrolled step.
        """
        cfg = self.config
        last = hidden_states.shape[-1]
        if last == cfg.fc_input_size and last != cfg.hidden_size:
            hidden_states = self.fc(hidden_states)
        elif last != cfg.hidden_size:
            raise ValueError(f"hidden_states last dim {last}: expected {cfg.fc_input_size} or {cfg.hidden_size}")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        inputs_embeds = inputs_embeds.to(hidden_states.dtype)
        b, t = inputs_embeds.shape[:2]
        if position_ids is None:
            start = 0 if past_kv is None else past_kv[0].shape[2]
            position_ids = torch.arange(start, start + t, device=hidden_states.device)
        if position_ids.dim() == 1:
            position_ids = position_ids.unsqueeze(0).expand(b, t)
        cos, sin = self.rotary(position_ids, hidden_states.dtype)
        out, kv = self.midlayer(inputs_embeds, hidden_states, cos, sin, attn_mask, past_kv)
        logits = self.lm_head(self.norm(out))
        if use_cache:
            return out, logits, kv
        return out, logits

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Everything except the frozen embedding (what a checkpoint / export carries)."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("embed_tokens.")}


DRAFT_ARCHS = ("llama", "mla")


def build_draft(
    target_dir: str | Path,
    draft_vocab_size: int,
    aux_layer_ids: Sequence[int],
    *,
    arch: str = "llama",
    load_embeddings: bool = True,
    **overrides: Any,
) -> Eagle3Draft:
    """DraftConfig from the target's config.json, a fresh draft, the target's embedding copied in.

    ``arch``: "llama" (this module, vLLM's Eagle3LlamaForCausalLM) or "mla" (:mod:`eagle3.model_mla`,
    vLLM's Eagle3DeepseekV2ForCausalLM, for DeepSeek/Kimi-family targets)."""
    if arch == "mla":
        from eagle3.model_mla import build_mla_draft

        return build_mla_draft(target_dir, draft_vocab_size, aux_layer_ids, load_embeddings=load_embeddings,
                               **overrides)
    if arch != "llama":
        raise ValueError(f"unknown draft arch {arch!r}; known: {DRAFT_ARCHS}")
    cfg = DraftConfig.from_target(Path(target_dir), draft_vocab_size, aux_layer_ids, **overrides)
    model = Eagle3Draft(cfg)
    if load_embeddings:
        model.load_embeddings(target_dir)
    return model


__all__ = [
    "DRAFT_ARCHS",
    "DraftConfig",
    "Eagle3Draft",
    "EMBED_NAMES",
    "LM_HEAD_NAMES",
    "build_draft",
    "has_target_tensor",
    "load_target_embeddings",
    "load_target_tensor",
    "rope_inv_freq",
]

