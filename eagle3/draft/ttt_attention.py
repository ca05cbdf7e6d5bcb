"""TTT attention without a dense mask: one causal SDPA per step, the diagonals folded in as sinks.

TTT step i (docs/train.md, eagle3/train/ttt.py) lets query t see step 0's keys ``s <= t``
(causal) and, in each of the blocks 1..i, only key t (the diagonal). The reference path builds a
``[T, (i+1)T]`` boolean mask over the concatenated keys, which keeps SDPA off its causal kernels
and computes ``(i+1)T`` scores per query where ``T/2 + i`` are needed.

Here the i diagonal keys become extra *shared* key rows ("sinks") in front of step 0's keys,
and each query carries its own diagonal scores in extra head dimensions::

    q'_t   = [q_t, 0.., hi(q_t.k_1[t]), .., hi(q_t.k_i[t]), 0.., lo(..), .., 0..]   (width W)
    sink r = [0,   one-hot at the column of its diagonal (hi and lo)]               key rows
    k'     = [sink_1 .. sink_S, k0_0 .. k0_{T-1}] zero-padded to W;  v' likewise, a sink's value
             is a one-hot in an extra value column
    out'   = causal SDPA over i dummy query rows + T queries and the S' = i sinks + T keys

So query t's scores are ``scale q_t.k0_s`` for ``s <= t`` plus exactly its own diagonal scores
(``scale * (hi + lo)``), one softmax over all of them: the extra value columns of ``out'`` are
the diagonal probabilities p_j[t], and ``out = out'[:dv] + sum_j p_j[t] v_j[t]``. Exact (the same
softmax, the same terms), differentiable by plain autograd through SDPA's causal kernel (flash
on CPU and CUDA), with no mask and no growing key/value concatenation: the padded step-0
keys/values with all sink rows are built once per forward and every step reads a view of them.
The hi/lo split keeps the diagonal scores at ~16 bits in bf16 (one bf16 number has 8); float32
needs only hi. The i dummy query rows make the causal square (T+i): they see only sinks and
their outputs are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def _round8(n: int) -> int:
    return (n + 7) // 8 * 8


@dataclass(frozen=True)
class TTTPrefix:
    """What TTT step i >= 1 attends to besides its own keys: step 0's keys/values behind all the
    sink rows (built once), and the (k, v) of steps 1..i-1 (their diagonals)."""

    k0: torch.Tensor  # [B, kv_heads, S + T, Wk]: S sink rows, then step 0's keys, zero-padded
    v0: torch.Tensor  # [B, kv_heads, S + T, Wv]
    diag: tuple[tuple[torch.Tensor, torch.Tensor], ...]  # (k_j, v_j) of steps 1..i-1, unpadded
    sinks: int  # S = ttt_steps - 1, the most diagonals any step has
    dk: int  # head dims before padding
    dv: int
    split: bool  # hi + lo columns per diagonal score (bf16 / fp16 inputs)

    @staticmethod
    def start(kv: tuple[torch.Tensor, torch.Tensor], ttt_steps: int) -> TTTPrefix:
        """The prefix of step 1 from step 0's (k, v), room for ``ttt_steps - 1`` diagonals."""
        k, v = kv
        s = max(ttt_steps - 1, 1)
        split = k.dtype != torch.float32
        dk, dv = k.shape[-1], v.shape[-1]
        # one width for keys and values: SDPA's flash kernel (the only one taking enable_gqa;
        # others fall back to the math path) needs equal head dims, a multiple of 8
        wk = wv = max(_round8(dk + s * (2 if split else 1)), _round8(dv + s))
        b, h = k.shape[:2]
        eye = torch.eye(s, dtype=k.dtype, device=k.device)
        sk = k.new_zeros(s, wk)
        sk[:, dk : dk + s] = eye
        if split:
            sk[:, dk + s : dk + 2 * s] = eye
        sv = v.new_zeros(s, wv)
        sv[:, dv : dv + s] = eye
        k0 = torch.cat([sk.expand(b, h, s, wk), F.pad(k, (0, wk - dk))], dim=2)
        v0 = torch.cat([sv.expand(b, h, s, wv), F.pad(v, (0, wv - dv))], dim=2)
        return TTTPrefix(k0, v0, (), s, dk, dv, split)

    def extend(self, kv: tuple[torch.Tensor, torch.Tensor]) -> TTTPrefix:
        """The prefix of the next step: this step's (k, v) becomes one more diagonal."""
        return TTTPrefix(
            self.k0, self.v0, (*self.diag, kv), self.sinks, self.dk, self.dv, self.split
        )


def _per_head(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, kv_heads, ...] -> [B, kv_heads, group, ...] view matching ``heads`` query heads
    (SDPA's GQA convention: query head h reads kv head h // group)."""
    return x.unsqueeze(2).expand(x.shape[0], x.shape[1], heads // x.shape[1], *x.shape[2:])


def ttt_attend(
    q: torch.Tensor,
    kv: tuple[torch.Tensor, torch.Tensor],
    prefix: TTTPrefix,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """Attention output [B, heads, T, dv] of TTT step i = len(prefix.diag) + 1 (module docstring).

    ``q`` [B, heads, T, dk] (RoPE applied), ``kv`` this step's (k, v) [B, kv_heads, T, d]."""
    b, n, t, dk = q.shape
    diag = (*prefix.diag, kv)
    i, s = len(diag), prefix.sinks
    if i > s:
        raise ValueError(f"TTT step {i} but the prefix has room for {s} diagonals")
    scale = dk**-0.5 if scale is None else scale
    nk = prefix.k0.shape[1]
    qg = q.view(b, nk, n // nk, t, dk).float()
    scores = torch.stack(
        [(qg * k.float().unsqueeze(2)).sum(-1).reshape(b, n, t) for k, _ in diag], dim=-1
    )  # [B, n, T, i] unscaled q_t . k_j[t], float32
    hi = scores.to(q.dtype)
    cols = [q, q.new_zeros(b, n, t, s - i), hi]
    if prefix.split:
        cols += [q.new_zeros(b, n, t, s - i), (scores - hi.float()).to(q.dtype)]
    wk = prefix.k0.shape[-1]
    qx = torch.cat(cols, dim=-1)
    qx = F.pad(qx, (0, wk - qx.shape[-1], i, 0))  # [B, n, i + T, Wk]: i dummy rows first
    k0, v0 = prefix.k0[:, :, s - i :], prefix.v0[:, :, s - i :]  # i sinks, then step 0's
    out = F.scaled_dot_product_attention(
        qx, k0, v0, is_causal=True, scale=scale, enable_gqa=enable_gqa
    )[:, :, i:]
    dv = prefix.dv
    o = out[..., :dv]
    p = out[..., dv + s - i : dv + s]  # [B, n, T, i]: the diagonal probabilities
    og = o.reshape(b, nk, n // nk, t, dv)
    pg = p.reshape(b, nk, n // nk, t, i)
    for j, (_, v) in enumerate(diag):
        og = og + pg[..., j : j + 1] * v.unsqueeze(2)
    return og.reshape(b, n, t, dv)


__all__ = ["TTTPrefix", "ttt_attend"]
