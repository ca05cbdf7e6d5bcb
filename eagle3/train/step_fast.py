"""The fast optimizer step: :func:`eagle3.train.step.train_step`'s semantics with no host sync.

Everything the reference step reads on the host inside the step (per-TTT-step ``int``/``float``
of the loss sums, the gradient norm before deciding to step) stays on the device here: the
NaN guard becomes fused AdamW's ``found_inf`` (the update and its step count are skipped on the
device when the loss or the gradient norm is not finite, as the reference skips ``opt.step()``),
and the metrics are one packed tensor copied to the host without blocking. The caller reads them
through :meth:`PendingStep.resolve` when it needs them (the train loop: after it has queued the
next step, so the GPU never waits for the host). Without a fused optimizer (CPU runs) the guard
reads the flag on the host, which costs nothing there.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from eagle3.train.batch import Batch
from eagle3.train.distributed import Dist, grad_sync
from eagle3.train.ttt import objective

Marks = Callable[[str], None] | None


@dataclass
class StepResult:
    loss: float  # global weighted TTT loss (nan/inf: the step was skipped)
    stats: list[dict]  # global, per loss column (eagle3.train.ttt): {loss, correct, count}
    grad_norm: float
    finite: bool  # the optimizer stepped


class PendingStep:
    """A step's metrics on their way to the host (packed: total, grad norm, finite, sums)."""

    def __init__(
        self, total: torch.Tensor, sums: torch.Tensor, gnorm: torch.Tensor, finite: torch.Tensor
    ) -> None:
        self.columns = sums.shape[1]
        packed = torch.cat(
            [total.view(1), gnorm.double().view(1), finite.double().view(1), sums.flatten()]
        )
        self.event = None
        if packed.is_cuda:
            packed = packed.to("cpu", non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        self.packed = packed

    def resolve(self) -> StepResult:
        """Wait for this step only (not for what was queued after it) and read its metrics."""
        if self.event is not None:
            self.event.synchronize()
        v = self.packed.tolist()
        k = self.columns
        ce, correct, count = v[3 : 3 + k], v[3 + k : 3 + 2 * k], v[3 + 2 * k :]
        per_step = [
            {"loss": ce[i] / max(count[i], 1.0), "correct": int(correct[i]), "count": int(count[i])}
            for i in range(k)
        ]
        total, gnorm = v[0], v[1]
        finite = bool(v[2]) and math.isfinite(total) and math.isfinite(gnorm)
        return StepResult(total, per_step, gnorm, finite)


def global_denominator(counts: torch.Tensor, d: Dist) -> torch.Tensor:
    """Counted positions per TTT step of the global batch (all ranks), at least 1: each
    micro-batch's loss is then its exact share of the global loss."""
    if d.world > 1:
        dist.all_reduce(counts)
    return counts.clamp(min=1).float()


def forward_backward(
    net: nn.Module,
    micro: list[Batch],
    d: Dist,
    denom: torch.Tensor,
    autocast: contextlib.AbstractContextManager,
    mark: Callable[[str], None],
) -> Iterator[Any]:
    """Forward and backward of each micro-batch (gradients synced across ranks on the last one
    only; x ``d.world`` undoes DDP's / FSDP's averaging); yields each one's loss statistics."""
    for j, b in enumerate(micro):
        with grad_sync(net, d, j == len(micro) - 1):
            with autocast:
                loss, stats = net(b, denom)
            mark("forward")
            (loss * d.world).backward()
            mark("backward")
        yield stats


def is_fused(opt: torch.optim.Optimizer) -> bool:
    """Whether every group runs the fused AdamW kernel (not Muon's, not foreach)."""
    return all(g.get("fused") for g in opt.param_groups)


def clip_gradients(
    opt: torch.optim.Optimizer, params: list[torch.Tensor], clip: float
) -> torch.Tensor:
    """The gradients' global norm (before clipping), and the clip to ``clip``. A fused AdamW
    applies the clip itself: the factor goes in as its ``grad_scale`` (what GradScaler uses to
    unscale; the kernel divides each gradient as it reads it), which saves a read and a write
    of every gradient (~3 GB at Kimi dims). Else ``clip_grad_norm_`` (same factor: the norm over
    ``clip``, at least 1)."""
    if not is_fused(opt):
        gnorm = torch.nn.utils.clip_grad_norm_(params, clip)
        return gnorm.full_tensor() if isinstance(gnorm, DTensor) else gnorm
    gnorm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    opt.grad_scale = ((gnorm + 1e-6) / clip).clamp(min=1.0).float()  # type: ignore[attr-defined]
    return gnorm


def step_if_finite(opt: torch.optim.Optimizer, finite: torch.Tensor) -> None:
    """``opt.step()`` only where ``finite``: on the device for a fused optimizer (its
    ``found_inf``, as GradScaler uses it: no update, step count unchanged), else on the host."""
    if is_fused(opt):
        opt.found_inf = (~finite).float()  # type: ignore[attr-defined]
        opt.step()
    elif bool(finite):
        opt.step()


def fast_train_step(
    net: nn.Module,
    opt: torch.optim.Optimizer,
    params: list[torch.Tensor],
    micro: list[Batch],
    d: Dist,
    grad_clip: float,
    autocast: contextlib.AbstractContextManager,
    marks: Marks = None,
) -> PendingStep:
    """One optimizer step on this rank's micro-batches (the reference step's semantics: the
    per-step denominators of the global batch all-reduced first, x ``d.world`` against the
    gradient averaging, a non-finite loss or norm skips the step on every rank alike)."""
    mark = marks or (lambda _name: None)
    obj = objective(net)
    denom = global_denominator(sum(obj.counts(b) for b in micro), d)
    sums = torch.zeros(3, len(obj.offsets), dtype=torch.float64, device=denom.device)
    for stats in forward_backward(net, micro, d, denom, autocast, mark):
        sums += stats
    if d.world > 1:
        dist.all_reduce(sums)
    total = (obj.weights(sums.device) * sums[0] / sums[2].clamp(min=1)).sum()
    gnorm = clip_gradients(opt, params, grad_clip)
    finite = torch.isfinite(total) & torch.isfinite(gnorm)
    step_if_finite(opt, finite)
    opt.zero_grad(set_to_none=True)
    mark("optimizer")
    return PendingStep(total, sums, gnorm, finite)


__all__ = [
    "Marks",
    "PendingStep",
    "StepResult",
    "clip_gradients",
    "fast_train_step",
    "forward_backward",
    "global_denominator",
    "step_if_finite",
]
