"""What the Llama and the MLA draft share: config helpers, RMSNorm, the MLP, masked attention over
a KV prefix, the decoder layer around an attention module, and the draft model around that layer.

Each architecture module (:mod:`eagle3.draft.llama`, :mod:`eagle3.draft.mla`) brings its config,
its RoPE and its attention; both import this module and never each other.

The forward is vLLM's, step for step (``LlamaDecoderLayer.forward`` with ``layer_idx == 0`` and
``LlamaModel.forward`` of llama_eagle3.py; deepseek_eagle3.py is the same around MLA)::

    hidden   = fc(aux)                       # only for target states; later steps pass H wide
    residual = hidden                        # norm_before_residual=False (vLLM's default here)
    x        = cat([input_layernorm(embed(ids)), hidden_norm(hidden)], -1)   # EMBEDS FIRST, 2H
    residual = self_attn(x) + residual
    out      = mlp(post_attention_layernorm(residual)) + residual
    logits   = lm_head(norm(out))            # [.., D]; target id of row i is i + d2t[i]
    return out, logits                       # ``out`` (pre-norm) feeds vLLM's next draft step

Alignment (as vLLM's proposer does it): the hidden state at position t is paired with the token
at position t+1 (the token the target emitted after it), and the logits at t predict token t+2.
The trainer shifts the ids; the draft only pairs what it is given position by position.

Attention masks and KV prefixes (for the training-time test, TTT; see :func:`attend`):

- ``attn_mask=None`` and no ``past_kv``: causal over the T positions.
- ``past_kv=(k, v)`` (keys already rotated, as returned by ``forward(..., use_cache=True)``): the
  new keys/values are appended after the prefix. With ``attn_mask=None`` query i attends to the
  whole prefix and to new positions ``<= i``.
- ``attn_mask``: explicit, broadcastable to ``[B, heads, T, S + T]`` (S = prefix length, 0
  without a prefix). Boolean: True = may attend (torch SDPA convention). Floating point:
  additive (0 = attend, -inf = masked). It replaces the causal default entirely.
"""

from __future__ import annotations

import json
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from eagle3.draft.ttt_attention import TTTPrefix, ttt_attend
from eagle3.target_checkpoint import EMBED_NAMES, load_target_tensor

KVCache = tuple[torch.Tensor, torch.Tensor]


class LayerCaches(tuple):
    """The KV prefix of a draft with several layers: one entry (a ``(k, v)`` or a
    :class:`TTTPrefix`) per layer, layer 0 first. A one-layer draft keeps its bare entry, so its
    callers and tests see what they always saw."""


def per_layer(fn: Any, *caches: Any) -> Any:
    """``fn`` of each layer's entries of ``caches`` (:class:`LayerCaches`), or of the caches
    themselves (one layer): how the TTT unroll and the offline chains grow a prefix."""
    if isinstance(caches[0], LayerCaches):
        return LayerCaches(fn(*parts) for parts in zip(*caches))
    return fn(*caches)


def extend_prefix(past: Any, kv: Any) -> Any:
    """The KV prefix ``past`` (None: empty) with one more call's keys/values appended along the
    positions (each layer's with several): the TTT unroll's and the offline chains' growth."""
    if past is None:
        return kv
    return per_layer(lambda p, n: tuple(torch.cat([a, b], 2) for a, b in zip(p, n)), past, kv)


# ---------------------------------------------------------------------------------------------
# Config helpers
# ---------------------------------------------------------------------------------------------


class ConfigMethods:
    """What both draft configs (dataclasses) derive the same way from their fields
    ``rope_scaling``, ``target_hidden_size`` and ``aux_layer_ids``."""

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


def read_config(target_config: dict[str, Any] | str | Path) -> dict[str, Any]:
    """A config dict as given, or read from a ``config.json`` file or its folder."""
    if isinstance(target_config, dict):
        return target_config
    p = Path(target_config)
    if p.is_dir():
        p = p / "config.json"
    return json.loads(p.read_text())


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The language model's part of a config (multimodal wrappers: Kimi-K2.5's ``text_config``)."""
    text = cfg.get("text_config") or cfg.get("language_config") or cfg
    return text if isinstance(text, dict) else cfg


def rope_from_config(c: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None) from transformers 4.x (rope_theta + rope_scaling) or
    5.x (rope_parameters) style configs."""
    params = c.get("rope_parameters")
    if (
        isinstance(params, dict)
        and params
        and not any(isinstance(v, dict) for v in params.values())
    ):
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


def check_common_fields(cfg: Any, mlp_name: str) -> None:
    """The checks both configs make on their shared fields (aux layers, vocab sizes, activation)."""
    cfg.aux_layer_ids = [int(i) for i in cfg.aux_layer_ids]
    if not cfg.aux_layer_ids:
        raise ValueError("aux_layer_ids must not be empty")
    if len(set(cfg.aux_layer_ids)) != len(cfg.aux_layer_ids):
        raise ValueError(f"aux_layer_ids must be distinct, got {cfg.aux_layer_ids}")
    if not 0 < cfg.draft_vocab_size <= cfg.vocab_size:
        raise ValueError(f"draft_vocab_size {cfg.draft_vocab_size} not in [1, {cfg.vocab_size}]")
    if cfg.hidden_act != "silu":
        raise ValueError(f"only silu MLPs are supported (vLLM's {mlp_name}), got {cfg.hidden_act}")


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the spelling of config.json's ``torch_dtype``)."""
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------------------------------------
# Layers
# ---------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """Llama RMSNorm, computed in float32 (as vLLM and HF do), cast back, then scaled in the
    input's dtype (as vLLM serves it: bf16 activations, bf16 weight). The fp32 master weight is
    cast for the product, so bf16 activations stay bf16 under autocast instead of being promoted
    to fp32 (and cast back by every projection that reads them); fp32 runs are unchanged."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight.to(dtype) * xf.to(dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


class MLP(nn.Module):
    """vLLM's LlamaMLP / DeepseekV2MLP: SiLU-gated, no biases. ``act`` is the elementwise part
    alone, so that ``train.compile`` can fuse it while the projections stay plain modules."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act = silu_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x), self.up_proj(x)))


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    past_kv: KVCache | TTTPrefix | None,
    **sdpa: Any,
) -> tuple[torch.Tensor, KVCache]:
    """SDPA over an optional KV prefix, with the mask convention of the module docstring.

    ``q`` [B, heads, T, d], ``k``/``v`` this call's keys and values (dim 2 = positions). Returns
    (attention output [B, heads, T, dv], this call's (k, v) without the prefix). Shared by the
    Llama and the MLA attention. A :class:`~eagle3.draft.ttt_attention.TTTPrefix` as ``past_kv``
    (the fast TTT step) takes the causal + diagonal path of :func:`ttt_attend`; no mask then."""
    t = q.shape[2]
    new_kv = (k, v)
    if isinstance(past_kv, TTTPrefix):
        return ttt_attend(
            q, new_kv, past_kv, sdpa.get("scale"), sdpa.get("enable_gqa", False)
        ), new_kv
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


class MidLayer(nn.Module):
    """vLLM's Eagle3 decoder layer with ``layer_idx == 0`` around the architecture's attention;
    returns (residual stream, kv)."""

    def __init__(self, cfg: Any, attention: type[nn.Module]) -> None:
        super().__init__()
        self.norm_before_residual = cfg.norm_before_residual
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = attention(cfg)
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
        return attention_and_mlp(self, x, residual, cos, sin, attn_mask, past_kv)


def attention_and_mlp(
    layer: nn.Module,
    x: torch.Tensor,
    residual: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    attn_mask: torch.Tensor | None,
    past_kv: Any,
) -> tuple[torch.Tensor, KVCache]:
    """What every decoder layer does after its input norms: attention over ``x`` added to
    ``residual``, then the MLP's residual block; returns (residual stream, kv)."""
    a, kv = layer.self_attn(x, cos, sin, attn_mask, past_kv)
    residual = a + residual
    return layer.mlp(layer.post_attention_layernorm(residual)) + residual, kv


class DecoderLayer(nn.Module):
    """vLLM's Eagle3 decoder layer with ``layer_idx >= 1``: a plain pre-norm Llama layer over the
    residual stream (H wide: no embeddings, no ``hidden_norm``); returns (residual stream, kv).

    vLLM's fused add-norms say the same: ``input_layernorm(h, residual)`` normalises the stream
    ``h + residual``, and ``post_attention_layernorm(a, residual)`` adds the attention to it."""

    def __init__(self, cfg: Any, attention: Any) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = attention(cfg, cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        past_kv: KVCache | None = None,
    ) -> tuple[torch.Tensor, KVCache]:
        return attention_and_mlp(self, self.input_layernorm(x), x, cos, sin, attn_mask, past_kv)


# ---------------------------------------------------------------------------------------------
# The draft
# ---------------------------------------------------------------------------------------------


class DraftModel(nn.Module):
    """The EAGLE-3 draft around one decoder layer; a subclass names its attention and RoPE.

    Parameter names are the checkpoint names vLLM loads (the architecture module lists them);
    the embedding is frozen and copied from the target (not exported)."""

    attention_cls: type[nn.Module]
    rotary_cls: type[nn.Module]

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)  # frozen: copied from the target
        self.fc = nn.Linear(cfg.fc_input_size, cfg.hidden_size, bias=False)
        self.midlayer = MidLayer(cfg, self.attention_cls)
        if getattr(cfg, "num_layers", 1) > 1:  # named layers.1.. as vLLM loads them
            self.layers = nn.ModuleDict(
                {str(j): DecoderLayer(cfg, self.attention_cls) for j in range(1, cfg.num_layers)}
            )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.rotary = self.rotary_cls(cfg)
        if getattr(cfg, "parallel_depths", 0):
            # P-EAGLE's placeholder hidden state, in the fc's input space (3 aux layers wide) as
            # vLLM keeps it: it goes through fc (vLLM: combine_hidden_states) like real states.
            # 1-D so that Muon (2-D matrices) leaves it to AdamW.
            self.mask_hidden = nn.Parameter(torch.zeros(cfg.fc_input_size))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Llama init: Linear weights N(0, initializer_range), norms 1. Embeddings untouched."""
        std = self.config.initializer_range
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, mean=0.0, std=std)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)
        if hasattr(self, "mask_hidden"):  # speculators' init: randn
            nn.init.normal_(self.mask_hidden)

    def load_embeddings(self, model_dir: str | Path) -> None:
        """Copy the target's input embedding (frozen), reading only that tensor from disk."""
        embed = load_target_tensor(model_dir, EMBED_NAMES)
        if tuple(embed.shape) != tuple(self.embed_tokens.weight.shape):
            raise ValueError(
                f"target embedding {tuple(embed.shape)} != draft "
                f"{tuple(self.embed_tokens.weight.shape)}"
            )
        with torch.no_grad():
            self.embed_tokens.weight.copy_(embed.to(self.embed_tokens.weight.dtype))

    def placeholder(self, b: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(embeddings [B, T, H], projected hidden states [B, T, H]) of parallel positions: the
        placeholder token's embedding and ``fc(mask_hidden)``, each one vector broadcast (vLLM
        projects mask_hidden once when it loads the draft and writes it into every mask slot)."""
        tok = torch.full((1, 1), self.config.parallel_token_id, device=self.mask_hidden.device)
        emb = self.embed_tokens(tok)
        return emb.expand(b, t, -1), self.fc(self.mask_hidden).expand(b, t, -1)

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
        logits_len: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, KVCache]:
        """One draft step.

        Args:
            input_ids: [B, T] token ids (the NEXT tokens relative to ``hidden_states``).
            hidden_states: [B, T, A*Ht] concatenated aux target states (projected by ``fc``) or
                [B, T, H] already-projected states (a previous step's returned ``out``). Which
                one is decided by the last dim (``fc_input_size`` vs ``hidden_size``).
            position_ids: [B, T] or [T]; default ``past_len + arange(T)``.
            attn_mask: see the module docstring (None: causal, offset by any prefix).
            past_kv: (k, v) prefix, each [B, heads, S, d], keys rotated (a :class:`LayerCaches`
                of them with several layers).
            use_cache: also return this call's (k, v) (without the prefix).
            inputs_embeds: [B, T, H] instead of embedding ``input_ids``.
            logits_len: logits of the first positions only (the fast TTT step's step i has no
                target beyond T-1-i: slicing ``out`` here, not the D-wide logits, saves the
                logits' slice copies in the backward).

        Returns:
            ``(out [B, T, H], logits [B, T, D])`` (+ ``(k, v)``, or a :class:`LayerCaches`, with
            ``use_cache``). ``out`` is the last layer's pre-norm residual stream: the hidden state
            of the next unrolled step.
        """
        cfg = self.config
        last = hidden_states.shape[-1]
        if last == cfg.fc_input_size and last != cfg.hidden_size:
            hidden_states = self.fc(hidden_states)
        elif last != cfg.hidden_size:
            raise ValueError(
                f"hidden_states last dim {last}: expected {cfg.fc_input_size} or {cfg.hidden_size}"
            )
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        inputs_embeds = inputs_embeds.to(hidden_states.dtype)
        b, t = inputs_embeds.shape[:2]
        layered = isinstance(past_kv, LayerCaches)
        first = past_kv[0] if layered else past_kv
        if position_ids is None:
            start = 0 if first is None else first[0].shape[2]
            position_ids = torch.arange(start, start + t, device=hidden_states.device)
        if position_ids.dim() == 1:
            position_ids = position_ids.unsqueeze(0).expand(b, t)
        cos, sin = self.rotary(position_ids, hidden_states.dtype)
        out, kv = self.midlayer(inputs_embeds, hidden_states, cos, sin, attn_mask, first)
        if hasattr(self, "layers"):
            kvs = [kv]
            for j, layer in enumerate(self.layers.values(), 1):
                out, kv = layer(out, cos, sin, attn_mask, past_kv[j] if layered else None)
                kvs.append(kv)
            kv = LayerCaches(kvs)
        logits = self.lm_head(self.norm(out if logits_len is None else out[:, :logits_len]))
        if use_cache:
            return out, logits, kv
        return out, logits

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Everything except the frozen embedding (what a checkpoint / export carries)."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("embed_tokens.")}
