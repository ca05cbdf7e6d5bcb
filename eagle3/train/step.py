"""One optimizer step over this rank's micro-batches (the optimizer and the schedule:
:mod:`eagle3.train.optim`).

:func:`train_step` runs the reference (``eager``) step or the fast one
(:mod:`eagle3.train.step_fast`), whichever the objective was built with."""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from eagle3.train.batch import Batch
from eagle3.train.distributed import Dist
from eagle3.train.step_fast import (
    Marks,
    PendingStep,
    StepResult,
    fast_train_step,
    forward_backward,
    global_denominator,
)
from eagle3.train.ttt import objective


def train_step(
    net: nn.Module,
    opt: torch.optim.Optimizer,
    params: list[torch.Tensor],
    micro: list[Batch],
    d: Dist,
    grad_clip: float,
    autocast: contextlib.AbstractContextManager,
    marks: Marks = None,
) -> StepResult:
    """One optimizer step on this rank's micro-batches; the global batch is all ranks' together.

    The per-step denominators (counted positions of the global batch) are all-reduced first, so
    each micro-batch's loss is its exact share of the global loss; x ``d.world`` undoes DDP's /
    FSDP's gradient averaging. A non-finite loss or gradient norm anywhere skips the step on every
    rank alike (the all-reduced sums and the norm of the all-reduced gradients are the same on all).
    ``marks(name)`` is called at the end of each phase (forward, backward, optimizer)."""
    pending = train_step_async(net, opt, params, micro, d, grad_clip, autocast, marks)
    return pending if isinstance(pending, StepResult) else pending.resolve()


def resolve_step_impl(setting: str) -> str:
    """``train.step_impl``: ``auto`` is ``fast`` on every device (on CPU it measured as fast as
    the reference, the demo's train stage included: docs/benchmarks.md, "Train stage")."""
    return "fast" if setting == "auto" else setting


def step_impl(net: nn.Module) -> str:
    """``eager`` or ``fast``: what the TTT objective (under DDP: its ``.module``) was built with."""
    return getattr(objective(net), "impl", "eager")


def train_step_async(
    net: nn.Module,
    opt: torch.optim.Optimizer,
    params: list[torch.Tensor],
    micro: list[Batch],
    d: Dist,
    grad_clip: float,
    autocast: contextlib.AbstractContextManager,
    marks: Marks = None,
) -> StepResult | PendingStep:
    """:func:`train_step`, the fast step's metrics left on their way to the host."""
    if step_impl(net) == "fast":
        return fast_train_step(net, opt, params, micro, d, grad_clip, autocast, marks)
    mark = marks or (lambda _name: None)
    obj = objective(net)
    denom = global_denominator(sum(obj.counts(b) for b in micro), d)
    sums = torch.zeros(3, len(obj.offsets), dtype=torch.float64, device=denom.device)  # ce, ok, n
    for stats in forward_backward(net, micro, d, denom, autocast, mark):
        sums += torch.tensor(
            [[s["sum"] for s in stats], [s["correct"] for s in stats], [s["count"] for s in stats]],
            dtype=torch.float64,
            device=sums.device,
        )
    if d.world > 1:
        dist.all_reduce(sums)
    per_step = [
        {
            "loss": float(sums[0, i] / max(float(sums[2, i]), 1.0)),
            "correct": int(sums[1, i]),
            "count": int(sums[2, i]),
        }
        for i in range(len(obj.offsets))
    ]
    total = sum(obj.ttt_decay**i * s["loss"] for i, s in zip(obj.offsets, per_step))
    gnorm_t = torch.nn.utils.clip_grad_norm_(params, grad_clip)
    gnorm = float(gnorm_t.full_tensor() if isinstance(gnorm_t, DTensor) else gnorm_t)
    finite = math.isfinite(total) and math.isfinite(gnorm)
    if finite:
        opt.step()
    opt.zero_grad(set_to_none=True)
    mark("optimizer")
    return StepResult(total, per_step, gnorm, finite)


def make_autocast(dev: torch.device, weight_cast: str, sdpa: str = "no_cudnn") -> Any:
    """bf16 autocast on CUDA, plus the attention kernels SDPA may pick (``train.sdpa``).
    Autocast's weight-cast cache is on for ``weight_cast == "cache"`` only (the reference step:
    one bf16 copy whose TTT-step gradients sum in bf16); ``per_use`` casts at every use and
    ``once`` casts in the fast step itself (:mod:`eagle3.train.weight_cast`), both summing the
    steps' weight gradients in fp32."""
    if dev.type != "cuda":
        return torch.autocast("cpu", enabled=False)
    cast = torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=weight_cast == "cache")
    return cast if sdpa == "auto" else StepContext(cast)


class StepContext:
    """Autocast, and SDPA kept off cuDNN's attention, around each forward (``train.sdpa:
    no_cudnn``). Why: on Hopper SDPA may pick cuDNN, which builds an execution graph for every
    new shape; padded batches of varying length (and each TTT step's own query count) are new
    shapes most steps of a first epoch. Measured on the H200 (docs/benchmarks.md, session 7):
    a new padded length every step costs 257 ms a step under PyTorch's choice, 41 ms here;
    flash / memory-efficient attention have no per-shape set-up."""

    def __init__(self, autocast: Any) -> None:
        self.autocast = autocast
        self.stack: contextlib.ExitStack | None = None

    def __enter__(self) -> StepContext:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        self.stack = contextlib.ExitStack()
        self.stack.enter_context(self.autocast)
        kernels = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
        self.stack.enter_context(sdpa_kernel(kernels))
        return self

    def __exit__(self, *exc: Any) -> Any:
        assert self.stack is not None
        return self.stack.__exit__(*exc)
