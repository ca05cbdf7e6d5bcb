"""Where an epoch's seconds went (``metrics.json`` epochs' ``time``): the host blocked on the
GPU for a step's metrics (``settle_s``), the rest (``host_s``), Python's GC (``gc_s``).

A clock of the test's own stands in for ``time.perf_counter`` in eagle3.train.progress: a step
"runs on the GPU" by moving it on when its metrics are read, so the split is exact, whatever the
machine's load."""

from __future__ import annotations

import gc

import pytest
import torch

from eagle3.train import progress
from eagle3.train.checkpoint import TrainState
from eagle3.train.progress import StepQueue
from eagle3.train.step_fast import PendingStep


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now


class GpuStep(PendingStep):
    """A step whose metrics arrive ``gpu_s`` after the host asks (the GPU still running it)."""

    def __init__(self, clock: Clock, gpu_s: float) -> None:
        z = torch.zeros(())
        super().__init__(z, torch.zeros(3, 1), z, torch.ones(()))
        self.clock, self.gpu_s = clock, gpu_s

    def resolve(self):
        self.clock.now += self.gpu_s
        return super().resolve()


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(progress, "time", c)

    def collector_takes(phase, info):  # after progress's own callback: a collection of 0.25 s
        if phase == "start":
            c.now += 0.25

    gc.disable()  # only the collection the test asks for
    gc.callbacks.append(collector_takes)
    yield c
    gc.callbacks.remove(collector_takes)
    gc.enable()


def test_settle_host_and_gc_seconds_add_up(clock):
    q = StepQueue(TrainState(), 3, None)
    t0 = clock.now
    for _ in range(3):
        clock.now += 0.05  # the host building and launching the next step
        q.push(GpuStep(clock, 0.1), 1e-3, 1)
    q.settle()  # the last step's metrics (pushes 2 and 3 read the ones before)
    gc.collect()
    t = q.take_times(t0, clock.now)
    assert t == {"host_s": 0.4, "settle_s": 0.3, "gc_s": 0.25, "alloc_retries": None}
    again = q.take_times(clock.now, clock.now)  # the counters start over
    assert again == {"host_s": 0.0, "settle_s": 0.0, "gc_s": 0.0, "alloc_retries": None}
