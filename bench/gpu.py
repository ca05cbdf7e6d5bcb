"""Shared by the benchmarks: device sync and the bf16 matmul rate measured in the same run (the
denominator of every MFU / FLOP-floor figure, so no peak number is taken from a datasheet)."""

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
