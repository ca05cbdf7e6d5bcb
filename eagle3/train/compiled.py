"""``torch.compile`` of the fast step's elementwise pieces (opt-in: ``bench/train.py --compile``).

What eager PyTorch runs as many small kernels, compiled into a few: each RMSNorm (float32
statistics, cast, scale), the MLP around its matmuls (SiLU x up), and the soft cross-entropy's
forward and backward math. Dynamic shapes (sequence lengths vary from batch to batch and the
logits shrink by one row per TTT step), so one compilation per piece serves the run. Off by
default: on CPU the compile time (seconds per piece on 2 cores) is more than a short run saves,
and on a GPU it is kept only where bench/train.py measures it faster (docs/benchmarks.md).
"""

from __future__ import annotations

import torch

from eagle3.draft.common import MLP, RMSNorm
from eagle3.train import ttt_fast


def compile_step(model: torch.nn.Module) -> None:
    """Compile, in place, the draft's norms and MLP and the fast step's loss math."""
    for m in model.modules():
        if isinstance(m, (RMSNorm, MLP)):
            m.forward = torch.compile(m.forward, dynamic=True)  # type: ignore[method-assign]
    ttt_fast.CE_IMPL["forward"] = torch.compile(ttt_fast._ce_forward, dynamic=True)
    ttt_fast.CE_IMPL["backward"] = torch.compile(ttt_fast._ce_backward_functional, dynamic=True)


__all__ = ["compile_step"]
