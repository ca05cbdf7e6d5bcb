"""The target side of the loss: the target's next-token distribution over the draft vocab.

The target model is never loaded: its final norm weight and its lm_head (tied: embed_tokens) are
read tensor by tensor from the checkpoint (:mod:`eagle3.target_checkpoint`). For each stored token
u the target distribution is ``softmax(lm_head(rmsnorm(final[u])))`` restricted to the draft-vocab
rows and renormalised, computed in chunks of ``chunk`` tokens (full-vocab logits exist only for
one chunk, only to find the target's argmax; a position whose argmax is outside the draft vocab is
masked).

The full-vocab argmax is the expensive part (Kimi-K2.5: 163,840 rows against 32,000 draft rows;
SmolLM2: 49,152 against 8,192) and it never changes for a stored token, so the fast paths compute
it once per sample (:mod:`eagle3.train.loader`, :mod:`eagle3.train.device_data`) and every later
batch of that sample runs the draft rows only (``arg=`` of :func:`target_distribution`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch
from torch import nn

from eagle3.target_checkpoint import NORM_NAMES, load_target_embeddings, load_target_tensor


@dataclass
class TargetHead:
    """What the target distribution needs: final norm, lm_head, and the draft vocab."""

    norm_weight: torch.Tensor  # [H]
    lm_head: torch.Tensor  # [V, H]
    draft_ids: torch.Tensor  # [D] target ids of the draft rows (ascending)
    t2draft: torch.Tensor  # [V] int64: draft index of a target id, -1 if not in the draft vocab
    eps: float

    @cached_property
    def draft_rows(self) -> torch.Tensor:
        """[D, H] lm_head[draft_ids], gathered once (contiguous) on the head's device at first
        use: the per-batch matmul once a sample's argmax is known."""
        return self.lm_head[self.draft_ids].contiguous()

    def to(self, device: torch.device | str) -> TargetHead:
        return TargetHead(
            self.norm_weight.to(device),
            self.lm_head.to(device),
            self.draft_ids.to(device),
            self.t2draft.to(device),
            self.eps,
        )


def load_target_head(target_dir: str | Path, draft_ids: torch.Tensor, eps: float) -> TargetHead:
    """Final norm + lm_head of the target read from its checkpoint (one tensor each)."""
    norm = load_target_tensor(target_dir, NORM_NAMES)
    _, head = load_target_embeddings(target_dir)
    draft_ids = draft_ids.to(torch.int64)
    t2draft = torch.full((head.shape[0],), -1, dtype=torch.int64)
    t2draft[draft_ids] = torch.arange(draft_ids.numel())
    return TargetHead(norm, head, draft_ids, t2draft, eps)


def _normed(final: torch.Tensor, head: TargetHead, dtype: torch.dtype) -> torch.Tensor:
    """The target's final RMSNorm of ``final`` (float32 statistics), in the head's ``dtype``."""
    x = final.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + head.eps) * head.norm_weight.float()
    return x.to(dtype)


@torch.no_grad()
def target_distribution(
    final: torch.Tensor, head: TargetHead, chunk: int = 256, arg: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """For final states [N, H]: (probs [N, D] float32 over the draft vocab, renormalised;
    target argmax as a draft index [N], -1 where the full-vocab argmax is outside the draft vocab).

    Full-vocab logits exist only for ``chunk`` rows at a time. Given ``arg`` (this function's or
    :func:`target_argmax`'s on the same states) only the draft rows are multiplied: the same
    logits (each is the same dot product), a fifth of the work at Kimi-K2.5's vocab."""
    n = final.shape[0]
    probs = torch.empty(n, head.draft_ids.numel(), dtype=torch.float32, device=final.device)
    out = torch.empty(n, dtype=torch.int64, device=final.device) if arg is None else arg.long()
    for a in range(0, n, chunk):
        x = _normed(final[a : a + chunk], head, head.lm_head.dtype)
        if arg is None:
            logits = (x @ head.lm_head.T).float()  # [c, V]
            out[a : a + chunk] = head.t2draft[logits.argmax(-1)]
            logits = logits[:, head.draft_ids]
        else:
            logits = (x @ head.draft_rows.T).float()  # [c, D]
        probs[a : a + chunk] = torch.softmax(logits, dim=-1)
    return probs, out


@torch.no_grad()
def target_argmax(final: torch.Tensor, head: TargetHead, chunk: int = 4096) -> torch.Tensor:
    """The argmax part of :func:`target_distribution` alone, for many states at once (every
    stored token, before training): [N] int32 draft index, -1 outside the draft vocab."""
    out = torch.empty(final.shape[0], dtype=torch.int32, device=final.device)
    for a in range(0, final.shape[0], chunk):
        logits = _normed(final[a : a + chunk], head, head.lm_head.dtype) @ head.lm_head.T
        out[a : a + chunk] = head.t2draft[logits.argmax(-1)]
    return out


def init_head_from_target(
    model: nn.Module, target_dir: str | Path, draft_ids: torch.Tensor, norm: bool = True
) -> None:
    """Start the draft's read-out as the target's own: ``lm_head`` rows = the target's lm_head rows
    of the draft vocab (tied targets: embedding rows), final ``norm`` = the target's final norm.

    Why: the draft's last hidden state is trained to predict what the target's final state
    predicts, through the same kind of RMSNorm + linear read-out. A random 32000 x H read-out
    (most of the draft's trainable weights) has to be learnt from the data; the target's is
    already right for every token, including the ones the data shows rarely. ``norm=False``
    keeps the final norm at 1 (speculators: the target's lm_head under a norm of its own)."""
    _, head = load_target_embeddings(target_dir)
    final_norm = load_target_tensor(target_dir, NORM_NAMES)
    ids = draft_ids.to(torch.int64)
    if (
        head.shape[1] != model.lm_head.weight.shape[1]
        or final_norm.shape != model.norm.weight.shape
    ):
        raise ValueError(
            "train.head_init=target needs the draft's hidden size "
            f"({model.lm_head.weight.shape[1]}) "
            f"to equal the target's ({head.shape[1]}); set train.head_init=random"
        )
    with torch.no_grad():
        model.lm_head.weight.copy_(head[ids].to(model.lm_head.weight.dtype))
        if norm:
            model.norm.weight.copy_(final_norm.to(model.norm.weight.dtype))
