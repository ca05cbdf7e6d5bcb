"""Where an epoch's seconds went (``metrics.json`` epochs' ``time``): the host blocked on the
GPU for a step's metrics (``settle_s``), the rest (``host_s``), Python's GC (``gc_s``)."""

from __future__ import annotations

import gc
import time

import torch

from eagle3.train.checkpoint import TrainState
from eagle3.train.progress import StepQueue
from eagle3.train.step_fast import PendingStep


class SlowStep(PendingStep):
    """A step whose metrics arrive ``wait`` s after the host asks (a GPU still running it)."""

    def __init__(self, wait: float) -> None:
        z = torch.zeros(())
        super().__init__(z, torch.zeros(3, 1), z, torch.ones(()))
        self.wait = wait

    def resolve(self):
        time.sleep(self.wait)
        return super().resolve()


def test_settle_host_and_gc_seconds_add_up():
    q = StepQueue(TrainState(), 3, None)
    t0 = time.perf_counter()
    for _ in range(3):
        time.sleep(0.05)  # the host building the next step
        q.push(SlowStep(0.1), 1e-3, 1)
    q.settle()
    junk = [[i] for i in range(200_000)]  # something for the collector to walk
    gc.collect()
    del junk
    t = q.take_times(t0)
    elapsed = time.perf_counter() - t0
    assert 0.29 <= t["settle_s"] <= 0.4  # three resolves of 0.1 s
    assert 0.15 <= t["host_s"] and abs(t["host_s"] + t["settle_s"] - elapsed) < 0.02
    assert 0 < t["gc_s"] <= t["host_s"]
    assert t["alloc_retries"] is None  # no CUDA here
    again = q.take_times(time.perf_counter())  # the counters start over
    assert again["settle_s"] == 0 and again["gc_s"] < 0.01
