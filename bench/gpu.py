"""Shared by the benchmarks: device sync, the bf16 matmul rate measured in the same run (the
denominator of every MFU / FLOP-floor figure, so no peak number is taken from a datasheet), time
per phase of a step, and torch.profiler's top kernels."""

from __future__ import annotations

import time

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def matmul_rate(device: torch.device, n: int = 8192, reps: int = 20) -> float:
    """FLOP/s of an n x n x n bf16 matrix product (mean of ``reps`` after 3 warm-ups)."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(device)
    return 2 * n**3 * reps / (time.perf_counter() - t0)


class Phases:
    """Time per phase of the measured steps: CUDA events (GPU time between the marks), or wall
    time on CPU. ``mark(name)`` ends the phase ``name`` (begun at the previous mark)."""

    def __init__(self, dev: torch.device) -> None:
        self.cuda = dev.type == "cuda"
        self.marks: list[tuple[str, object]] = []
        self.on = False

    def now(self) -> object:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def start(self) -> None:
        if self.on:
            self.marks.append(("", self.now()))

    def mark(self, name: str) -> None:
        if self.on:
            self.marks.append((name, self.now()))

    def totals(self, steps: int) -> dict[str, float]:
        """Seconds per step of each phase (after a sync)."""
        out: dict[str, float] = {}
        for (_, a), (name, b) in zip(self.marks, self.marks[1:]):
            if not name:
                continue
            dt = a.elapsed_time(b) / 1000 if self.cuda else b - a  # type: ignore[union-attr]
            out[name] = out.get(name, 0.0) + dt / steps
        return out


def profile_table(step, dev: torch.device, rows: int = 20) -> str:
    """torch.profiler over 2 steps: the top kernels by self device (CPU: self CPU) time."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(2):
            step()
        sync(dev)
    key = "self_device_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60)
