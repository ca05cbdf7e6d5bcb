"""``torch.compile`` of the fast step's elementwise pieces (``train.compile``; ``bench/train.py
--compile``).

What eager PyTorch runs as many small kernels, compiled into a few: each RMSNorm (float32
statistics, cast, scale), the MLP's SiLU x up, and the soft cross-entropy's forward and backward
math. The projections stay outside the compiled code: they are plain matmuls either way, and the
fast step swaps their forward for one that shares a bf16 weight copy across the TTT steps
(:mod:`eagle3.train.weight_cast`), which a compiled graph would capture once and then guard on.
Dynamic shapes (sequence lengths vary from batch to batch and the logits shrink by one row per
TTT step), so one compilation per piece serves the run. Per draft, nothing global: the compiled
forwards are set on the draft's own modules and the loss math as ``model.ce_impl``, which the
fast step reads.

``auto`` compiles on CUDA: measured faster on the H200 at both ends (docs/benchmarks.md, session 3:
Kimi dims TTT 7 9,343 -> 10,734 tokens/s, SmolLM2 dims 52,558 -> 66,202), not under FSDP (not run
on a GPU here) and not on the CPU, where compiling (seconds per piece on 2 cores) costs more than
a short run saves.
"""

from __future__ import annotations

from typing import Any

import torch

from eagle3.draft.common import MLP, RMSNorm, silu_mul
from eagle3.train import ttt_fast


def compile_step(model: torch.nn.Module) -> None:
    """Compile, in place, the draft's norms, its MLP's activation and (as ``model.ce_impl``) the
    fast step's loss math."""
    act = torch.compile(silu_mul, dynamic=True)
    for m in model.modules():
        if isinstance(m, RMSNorm):
            m.forward = torch.compile(m.forward, dynamic=True)  # type: ignore[method-assign]
        elif isinstance(m, MLP):
            m.act = act
    model.ce_impl = (
        torch.compile(ttt_fast._ce_forward, dynamic=True),
        torch.compile(ttt_fast._ce_backward_functional, dynamic=True),
    )


def maybe_compile(
    model: torch.nn.Module, setting: str, dev: torch.device, impl: str, mode: Any
) -> bool:
    """``train.compile`` resolved (on, off, or auto: CUDA, the fast step, not FSDP) and applied
    with :func:`compile_step`; whether it was."""
    on = impl == "fast" and (
        setting == "on" or (setting == "auto" and dev.type == "cuda" and mode != "fsdp")
    )
    if on:
        compile_step(model)
    return on


__all__ = ["compile_step", "maybe_compile"]
