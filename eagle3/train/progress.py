"""Counting optimizer steps: the NaN guard, progress reports, and one step in flight.

The fast step leaves its metrics on the device (:class:`~eagle3.train.step_fast.PendingStep`);
:class:`StepQueue` reads a step's metrics only once the next step has been queued, so the GPU
is never idle waiting for the host to look at a loss. The schedule position (step, batch in the
epoch) advances at once; what depends on the metrics (updates, skipped steps, the epoch sums,
the NaN guard, ``on_progress``) follows one step later, and everything is settled before a
checkpoint, at the end of an epoch and before returning, so a checkpoint is always exact.

It also says where an epoch's wall time went (:meth:`StepQueue.take_times`), because "the step
is slower" has had several causes (issue 38): the host building and launching steps, the host
waiting for the GPU, Python's garbage collector, the CUDA allocator flushing its cache.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from eagle3.errors import NoResult
from eagle3.train.checkpoint import TrainState
from eagle3.train.metrics import accumulate
from eagle3.train.step_fast import PendingStep, StepResult

MAX_CONSECUTIVE_NAN = 5
# A run where fewer than this fraction of the optimizer steps were finite is not a trained draft:
# it fails and exports nothing (2 steps, both NaN, used to be sealed as done: issue #16).
MIN_FINITE_FRACTION = 0.5


class TrainingDiverged(NoResult, RuntimeError):
    """Too many non-finite steps in a row, or too few finite steps in all: nothing exported."""


def count_result(state: TrainState, r: StepResult, step: int) -> None:
    """Count the outcome of step ``step``; too many non-finite steps in a row stop the run."""
    if r.finite:
        state.updates += 1
        state.consecutive_nan = 0
        accumulate(state, r.stats)
    else:
        state.skipped_nan += 1
        state.consecutive_nan += 1
    if state.consecutive_nan >= MAX_CONSECUTIVE_NAN:
        raise TrainingDiverged(
            f"{state.consecutive_nan} non-finite steps in a row (last at step "
            f"{step}, {state.skipped_nan} skipped in all): check the data / lr"
        )


def check_finite(state: TrainState, extract_dir: Path) -> None:
    """Refuse to export a draft that (almost) never took a finite step."""
    if state.step and state.updates >= MIN_FINITE_FRACTION * state.step and state.updates > 0:
        return
    raise TrainingDiverged(
        f"only {state.updates} of {state.step} optimizer steps were finite (at least "
        f"{MIN_FINITE_FRACTION:.0%} are required): the draft is not trained, nothing was "
        f"exported or sealed. Check {extract_dir} for NaN/inf states (extract drops them) and "
        "train.lr, then rerun train (delete its checkpoints/ to start over)"
    )


class _GcClock:
    """Seconds Python's garbage collector has run in this process (a ``gc.callbacks`` entry)."""

    def __init__(self) -> None:
        self.total, self._t0 = 0.0, 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.total += time.perf_counter() - self._t0


_GC = _GcClock()
gc.callbacks.append(_GC)


def _alloc_retries() -> int | None:
    """The CUDA caching allocator's flush-and-retry count so far (each one synchronises the
    device); None without CUDA."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return int(torch.cuda.memory_stats().get("num_alloc_retries", 0))


class StepQueue:
    """At most one step whose metrics are not read yet (see the module docstring)."""

    def __init__(
        self,
        state: TrainState,
        total_steps: int,
        on_progress: Callable[[dict[str, Any]], None] | None,
    ) -> None:
        self.state = state
        self.total_steps = total_steps
        self.on_progress = on_progress
        self.pending: tuple[StepResult | PendingStep, dict[str, Any]] | None = None
        self._settle_s, self._gc0 = 0.0, _GC.total

    def take_times(self, since: float, now: float) -> dict[str, Any]:
        """Where the seconds from ``since`` to ``now`` (``time.perf_counter()``: the epoch's start
        and end) went: ``settle_s`` reading the steps' metrics (the host blocked on the GPU: a
        GPU-bound loop spends its time here), ``host_s`` the rest (batches built, kernels
        launched, progress, checkpoints: a host-bound loop's), ``gc_s`` of it Python's garbage
        collector, and the CUDA allocator's retries so far."""
        out = {
            "host_s": round(now - since - self._settle_s, 2),
            "settle_s": round(self._settle_s, 2),
            "gc_s": round(_GC.total - self._gc0, 2),
            "alloc_retries": _alloc_retries(),
        }
        self._settle_s, self._gc0 = 0.0, _GC.total
        return out

    def push(self, r: StepResult | PendingStep, lr: float, n_batches: int, tokens: int = 0) -> None:
        """A step just queued: advance the position, then settle the step before it.
        ``tokens``: the real tokens of the step's global batch (the MFU's numerator)."""
        s = self.state
        s.step += 1
        s.batch_in_epoch += n_batches
        info = {"step": s.step, "total_steps": self.total_steps, "epoch": s.epoch, "lr": lr}
        info["tokens"] = tokens
        previous, self.pending = self.pending, (r, info)
        if previous is not None:
            self._count(*previous)

    def settle(self) -> None:
        """Read and count the step in flight (before a checkpoint, an epoch's end, a return)."""
        if self.pending is not None:
            previous, self.pending = self.pending, None
            self._count(*previous)

    def _count(self, r: StepResult | PendingStep, info: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        res = r.resolve() if isinstance(r, PendingStep) else r
        self._settle_s += time.perf_counter() - t0
        count_result(self.state, res, info["step"])
        if self.on_progress is not None:
            self.on_progress(
                info
                | {
                    "loss": res.loss if res.finite else None,
                    "grad_norm": res.grad_norm,
                    "steps": res.stats,
                    "skipped_nan": self.state.skipped_nan,
                }
            )


__all__ = [
    "MAX_CONSECUTIVE_NAN",
    "MIN_FINITE_FRACTION",
    "StepQueue",
    "TrainingDiverged",
    "check_finite",
    "count_result",
]
