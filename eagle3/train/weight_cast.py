"""Each trainable Linear weight cast to bf16 once per forward; its TTT steps' gradients summed in
fp32 (the fast step under autocast: ``train.weight_cast``, ``bench/train.py --weight-cast``).

Why: the fast step unrolls the draft's one decoder layer ``ttt_steps`` times, and every unrolled
step multiplies the same weights. Autocast offers two ways to run that, both costly:

- ``per_use`` (autocast's cache off, the fast step until session 10): every use casts the fp32
  weight again and keeps its own bf16 copy for the backward, whose gradient is cast back to fp32
  before autograd adds the uses up. Measured on the H200 (docs/benchmarks.md, session 3) at 13% of
  a Kimi TTT-7 step and 9 GiB (9,343 against 10,555 tokens/s).
- ``cache`` (autocast's cache on, the reference step): one cast, but all uses share that bf16
  tensor, so autograd sums the 7 steps' weight gradients in bf16 before the one cast to fp32.

``once`` (here): one bf16 copy per weight per forward, saved once for the backward; each use's
bf16 weight gradient (what the per-use path computes, bit for bit) is added into one fp32 sum as
soon as it exists; an anchor node hands the sum to the parameter after the last use's backward
(autograd runs a node only after everything that feeds it), so ``.grad``, DDP's hooks,
accumulation over micro-batches and clipping see an ordinary fp32 gradient. Per use that is 2
bytes written by the GEMM plus 10 for the fp32 add, about as much memory traffic as the cache's
bf16 adds and half the per-use path's. Same result as ``per_use`` up to the order of the adds.

Frozen weights are not touched (on CUDA they are held in bf16 already:
:func:`eagle3.train.distributed.hold_frozen_bf16`). Not under FSDP, whose unsharded parameters
and post-backward reduce-scatter this has not been run against.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn


class _Slot:
    """One weight's bf16 copy for this forward and the fp32 sum of its uses' gradients."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype) -> None:
        self.wb = weight.detach().to(dtype)
        self.acc: torch.Tensor | None = None

    def add(self, grad: torch.Tensor) -> None:
        if self.acc is None:
            self.acc = grad.float()
        else:
            self.acc.add_(grad)  # fp32 += bf16: one kernel, no fp32 copy of the bf16 gradient


class _Anchor(torch.autograd.Function):
    """A scalar that every use of the weight takes as an input: its backward runs after all of
    theirs and hands the fp32 sum to the weight."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, slot: _Slot) -> torch.Tensor:  # type: ignore[override]
        ctx.slot = slot
        return weight.new_zeros(())

    @staticmethod
    def backward(ctx, _grad: torch.Tensor):  # type: ignore[override]
        acc, ctx.slot.acc = ctx.slot.acc, None
        return acc, None


class _CastLinear(torch.autograd.Function):
    """``F.linear(x, weight)`` in bf16 on the shared copy; the weight gradient goes to the slot."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, x: torch.Tensor, _anchor: torch.Tensor, slot: _Slot
    ) -> torch.Tensor:
        xb = x.to(slot.wb.dtype)
        ctx.save_for_backward(xb)
        ctx.slot = slot
        return F.linear(xb, slot.wb)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        (xb,) = ctx.saved_tensors
        slot = ctx.slot
        gx = grad @ slot.wb if ctx.needs_input_grad[0] else None
        slot.add(grad.reshape(-1, grad.shape[-1]).t() @ xb.reshape(-1, xb.shape[-1]))
        return gx, None, None


def _forward(slot: _Slot, anchor: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    if anchor is None:  # no gradient wanted (torch.no_grad)
        return F.linear(x.to(slot.wb.dtype), slot.wb)
    return _CastLinear.apply(x, anchor, slot)


@contextlib.contextmanager
def weights_cast_once(model: nn.Module, dtype: torch.dtype) -> Iterator[None]:
    """Within: each trainable ``nn.Linear`` (no bias, as the drafts' are) of ``model`` runs on one
    ``dtype`` copy of its weight, with its gradient summed in fp32 (module docstring). The
    backward may run after the block; what it needs lives in the graph."""
    patched: list[nn.Linear] = []
    try:
        for m in model.modules():
            if not isinstance(m, nn.Linear) or m.bias is not None or "forward" in vars(m):
                continue
            w = m.weight
            if not w.requires_grad or w.dtype == dtype:
                continue
            slot = _Slot(w, dtype)
            anchor = _Anchor.apply(w, slot) if torch.is_grad_enabled() else None
            m.forward = lambda x, s=slot, a=anchor: _forward(s, a, x)  # type: ignore[method-assign]
            patched.append(m)
        yield
    finally:
        for m in patched:
            del m.forward


def set_weight_cast(
    model: nn.Module, setting: str, dev: torch.device, impl: str, mode: str | None
) -> str:
    """``train.weight_cast`` resolved for this run and set on the draft (``model.weight_cast``,
    which the fast step reads). ``auto``: ``once`` for the fast step on CUDA (not FSDP), else what
    autocast does for the step (``per_use`` fast under FSDP, ``cache`` eager); ``once`` is the
    fast step's only (the reference step keeps autocast's cache). ``none`` on the CPU, where the
    step runs in fp32 and nothing is cast."""
    if dev.type != "cuda":
        resolved = "none"
    elif setting == "auto":
        resolved = "cache" if impl != "fast" else ("per_use" if mode == "fsdp" else "once")
    elif setting == "once" and impl != "fast":
        resolved = "cache"
    else:
        resolved = setting
    model.weight_cast = resolved
    return resolved


def cast_context(model: nn.Module, device_type: str) -> contextlib.AbstractContextManager:
    """What the fast step's forward runs in: :func:`weights_cast_once` where the draft was set to
    (``model.weight_cast == "once"``) and autocast is on for its device; else nothing."""
    if getattr(model, "weight_cast", None) != "once" or not torch.is_autocast_enabled(device_type):
        return contextlib.nullcontext()
    return weights_cast_once(model, torch.get_autocast_dtype(device_type))


__all__ = ["cast_context", "set_weight_cast", "weights_cast_once"]
