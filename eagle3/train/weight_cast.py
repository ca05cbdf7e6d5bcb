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

``once`` (here): one bf16 copy per weight per forward, saved once for the backward. The weight
gradient is not computed use by use: each use's backward computes its input gradient and keeps
its output gradient g_i and its input x_i (saved for the backward anyway), and an anchor node,
which autograd runs only after every use's backward, computes ``[g_0; g_1; ...]^T [x_0; x_1; ...]``
as ONE GEMM with float32 output (cuBLAS accumulates in fp32 over all the steps' rows) and hands it
to the parameter. So ``.grad``, DDP's hooks, accumulation over micro-batches and clipping see an
ordinary fp32 gradient; the K steps' weight gradients are summed inside the GEMM (more exactly
than ``per_use``, whose each step's gradient is rounded to bf16 first), and written once (4
bytes a parameter) instead of K times (the cache: ~8 bytes a parameter per step, its bf16 output
and add; ``per_use``: ~26 with the casts and fp32 adds; ~34 / ~109 GB a Kimi TTT-7 step). The
price is one copy of the g_i and x_i into the GEMM's operands (~8 GB a Kimi TTT-7 step).
Memory: the held g_i (~250 MB a step at Kimi dims) grow while the backward frees far more
activations, so the peak (the start of the backward) does not move.

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

_MM_FP32: bool | None = None  # whether torch.mm takes out_dtype here (CUDA, torch >= 2.8)


def mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of bf16 matrices, accumulated and returned in float32: cuBLAS's fp32 output
    (``torch.mm(..., out_dtype=float32)``) on CUDA; elsewhere (the CPU runs this in tests only)
    the inputs upcast, which is the same sum. A CUDA torch without ``out_dtype`` gets the bf16
    GEMM (fp32 accumulation, the sum rounded to bf16 once), not a float32 GEMM at a tenth of
    the speed."""
    global _MM_FP32
    if not a.is_cuda:
        return a.float() @ b.float()
    if _MM_FP32 is None:
        try:
            t = torch.ones(2, 2, dtype=a.dtype, device=a.device)
            _MM_FP32 = torch.mm(t, t, out_dtype=torch.float32).dtype == torch.float32
        except (TypeError, RuntimeError):
            _MM_FP32 = False
    return torch.mm(a, b, out_dtype=torch.float32) if _MM_FP32 else torch.mm(a, b).float()


def fp32_output_gemm() -> bool | None:
    """Whether :func:`mm_fp32` found cuBLAS's fp32 output here (None: not asked yet, or CPU)."""
    return _MM_FP32


class _Slot:
    """One weight's bf16 copy for this forward, and what its uses' backwards left for the
    weight gradient (each use's output gradient and input, as [rows, features])."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype) -> None:
        self.wb = weight.detach().to(dtype)
        self.grads: list[torch.Tensor] = []
        self.inputs: list[torch.Tensor] = []

    def weight_grad(self) -> torch.Tensor | None:
        """All uses' weight gradient in one fp32 GEMM (None: no use had a gradient)."""
        if not self.grads:
            return None
        g = self.grads[0] if len(self.grads) == 1 else torch.cat(self.grads)
        x = self.inputs[0] if len(self.inputs) == 1 else torch.cat(self.inputs)
        self.grads, self.inputs = [], []
        return mm_fp32(g.t(), x)


class _Anchor(torch.autograd.Function):
    """A scalar that every use of the weight takes as an input: its backward runs after all of
    theirs and hands the weight its gradient."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, slot: _Slot) -> torch.Tensor:  # type: ignore[override]
        ctx.slot = slot
        return weight.new_zeros(())

    @staticmethod
    def backward(ctx, _grad: torch.Tensor):  # type: ignore[override]
        return ctx.slot.weight_grad(), None


class _CastLinear(torch.autograd.Function):
    """``F.linear(x, weight)`` in bf16 on the shared copy; the weight's share goes to the slot."""

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
        (xb,) = ctx.saved_tensors  # (autograd's check that nothing changed it in place)
        slot = ctx.slot
        gx = grad @ slot.wb if ctx.needs_input_grad[0] else None
        slot.grads.append(grad.reshape(-1, grad.shape[-1]))
        slot.inputs.append(xb.reshape(-1, xb.shape[-1]))
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


__all__ = ["cast_context", "fp32_output_gemm", "mm_fp32", "set_weight_cast", "weights_cast_once"]
