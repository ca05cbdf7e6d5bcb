"""The fast TTT step: the same unroll and loss as :mod:`eagle3.train.ttt`, computed without waste.

Same alignment, attention pattern, loss, weights and denominators as the reference
(:func:`eagle3.train.ttt.ttt_loss`, kept as ``train.step_impl: eager``); what differs is how:

- attention: step 0 is causal SDPA; step i >= 1 is one causal SDPA over step 0's keys with the
  i diagonals folded in (:mod:`eagle3.draft.ttt_attention`): no ``[T, (i+1)T]`` mask, no
  growing K/V concatenation, the causal kernels (flash) instead of a masked one.
- targets: step i's target is step 0's shifted by i+1 rows, read as a view with that offset
  (``probs[:, k:]`` against ``logits[:, :L-k]``) instead of a shifted copy of the
  ``[B, L, D]`` float32 distribution per step; the target distribution itself is computed once
  per batch (:func:`eagle3.train.batch.make_batch`).
- loss: :class:`SoftCrossEntropy` computes ``lse(x) sum(P) - P.x`` and its gradient
  ``(softmax(x) sum(P) - P) g`` directly: no float32 log-softmax kept per step.
- weights: each trainable projection cast to bf16 once per forward, the steps' weight gradients
  summed in fp32 (:mod:`eagle3.train.weight_cast`; under autocast, where the run asks for it).
- metrics: per-step sums (CE, correct, count) stay on the device as one ``[3, K]`` tensor; no
  ``int()``/``float()`` inside the step.
"""

from __future__ import annotations

import torch

from eagle3.draft import DraftModel
from eagle3.draft.common import per_layer
from eagle3.draft.ttt_attention import TTTPrefix
from eagle3.train.batch import Batch, shift_left
from eagle3.train.ttt import loss_offsets, step_counts
from eagle3.train.weight_cast import cast_context


def _ce_forward(logits: torch.Tensor, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = logits.float()
    psum = probs.sum(-1)
    return torch.logsumexp(x, dim=-1) * psum - (x * probs).sum(-1), psum


def _ce_backward(
    logits: torch.Tensor, probs: torch.Tensor, psum: torch.Tensor, grad: torch.Tensor
) -> torch.Tensor:
    g = torch.softmax(logits.float(), dim=-1)  # one kernel; then in place, no temporaries
    g.mul_(psum.unsqueeze(-1)).sub_(probs).mul_(grad.unsqueeze(-1))
    return g.to(logits.dtype)


def _ce_backward_functional(
    logits: torch.Tensor, probs: torch.Tensor, psum: torch.Tensor, grad: torch.Tensor
) -> torch.Tensor:
    g = torch.softmax(logits.float(), dim=-1) * psum.unsqueeze(-1) - probs
    return (g * grad.unsqueeze(-1)).to(logits.dtype)


#: the loss's math (forward, backward); a compiled draft carries its own as ``model.ce_impl``
#: (:func:`eagle3.train.compiled.compile_step`)
CE_EAGER = (_ce_forward, _ce_backward)


class SoftCrossEntropy(torch.autograd.Function):
    """Row-wise ``-sum_d P_d log softmax(x)_d`` for logits x [.., D] (any float dtype) and a
    target distribution P [.., D] (float32; a view is fine: it is saved, never copied).
    ``impl``: the (forward, backward) functions that compute it."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, logits: torch.Tensor, probs: torch.Tensor, impl: tuple = CE_EAGER
    ) -> torch.Tensor:
        ce, psum = impl[0](logits, probs)
        ctx.save_for_backward(logits, probs, psum)
        ctx.backward_impl = impl[1]
        return ce

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        logits, probs, psum = ctx.saved_tensors
        return ctx.backward_impl(logits, probs, psum, grad), None, None


def fast_unroll(model: DraftModel, batch: Batch, ttt_steps: int, parallel: int = 0):
    """Yield (chain position i, logits [B, L-1-i, D]: the positions with a target) of each loss
    column (the reference's unroll, with the step-0 keys + diagonals attention of
    :class:`TTTPrefix` instead of a mask and a KV concatenation; the parallel depths start their
    own prefix from step 0's keys)."""
    L, dev = batch.input_ids.shape[1], batch.input_ids.device
    pos = torch.arange(L, device=dev)
    hidden = batch.aux
    prefix: TTTPrefix | None = None
    kv0 = None
    for i in range(ttt_steps):
        ids = shift_left(batch.input_ids, 1 + i)
        out, logits, kv = model(
            ids, hidden, position_ids=pos + i, past_kv=prefix, use_cache=True,
            logits_len=max(L - 1 - i, 0),
        )  # fmt: skip
        yield i, logits
        kv0 = kv if kv0 is None else kv0
        if i + 1 < ttt_steps:
            prefix = (
                per_layer(lambda x: TTTPrefix.start(x, ttt_steps), kv)
                if prefix is None
                else per_layer(TTTPrefix.extend, prefix, kv)
            )
        hidden = out
    if parallel > 1:
        embeds, mask_h = model.placeholder(*batch.input_ids.shape)
        prefix = per_layer(lambda x: TTTPrefix.start(x, parallel), kv0)
        for d in range(1, parallel):
            _, logits, kv = model(
                batch.input_ids, mask_h, position_ids=pos + d, past_kv=prefix, use_cache=True,
                inputs_embeds=embeds, logits_len=max(L - 1 - d, 0),
            )  # fmt: skip
            yield d, logits
            prefix = per_layer(TTTPrefix.extend, prefix, kv)


def fast_ttt_loss(
    model: DraftModel,
    batch: Batch,
    ttt_steps: int,
    ttt_decay: float,
    denom: torch.Tensor | None = None,
    parallel: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weighted loss, per-column sums [3, columns] float64 on the device: CE sum, correct,
    count).

    Column c's loss is its CE summed over counted positions over ``denom[c]`` (default: this
    batch's count), as :func:`eagle3.train.ttt.ttt_loss`."""
    L = batch.input_ids.shape[1]
    dev = batch.input_ids.device
    if denom is None:
        denom = step_counts(batch, ttt_steps, parallel).clamp(min=1).float()
    total = torch.zeros((), device=dev)
    sums = torch.zeros(3, len(loss_offsets(ttt_steps, parallel)), dtype=torch.float64, device=dev)
    impl = getattr(model, "ce_impl", CE_EAGER)
    with cast_context(model, dev.type):
        for c, (i, logits) in enumerate(fast_unroll(model, batch, ttt_steps, parallel)):
            k = 1 + i
            if k >= L:  # nothing left to predict (a batch shorter than the unroll)
                total = total + 0.0 * logits.sum()
                continue
            lg = logits  # [B, L - k, D]
            ok = batch.target_ok[:, k:]
            ce = SoftCrossEntropy.apply(lg, batch.probs[:, k:], impl)
            ce_sum = (ce * ok).sum()
            total = total + (ttt_decay**i) * (ce_sum / denom[c])
            with torch.no_grad():
                correct = ((lg.argmax(-1) == batch.target_arg[:, k:]) & ok).sum()
                sums[:, c] = torch.stack(
                    [ce_sum.detach().double(), correct.double(), ok.sum().double()]
                )
    return total, sums


__all__ = ["SoftCrossEntropy", "fast_ttt_loss", "fast_unroll"]
