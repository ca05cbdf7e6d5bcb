"""The optimizer and the LR schedule of the train stage.

``train.optimizer: adamw`` is one AdamW over every trainable parameter. ``muon`` is what
speculators 0.9.0 trains with by default (and what closed most of the gap between our drafts and
its: docs/train.md, "Draft quality"): ``torch.optim.Muon`` (momentum 0.95, Nesterov, 5
Newton-Schulz steps, its update scaled to AdamW's RMS so the same lr suits both) over the 2-D
matrices of the layer and ``fc``, AdamW over the rest (norms, and lm_head when it trains: Muon
orthogonalises hidden-to-hidden maps, not read-outs). The two run as one :class:`MuonAdamW`, so
the step, the schedule (``param_groups``) and the checkpoint (``state_dict``) see one optimizer.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

# 2-D weights that stay with AdamW under Muon (speculators' and Keller Jordan's rule)
ADAMW_ONLY = ("embed_tokens", "lm_head")


def lr_at(
    step: int, total: int, base_lr: float, warmup_ratio: float, schedule: str = "cosine"
) -> float:
    """Linear warmup, then cosine or linear decay to 0: a pure function of the step (the
    scheduler's state is the step count, which the checkpoint holds)."""
    warmup = int(warmup_ratio * total)
    if step < warmup:
        return base_lr * (step + 1) / warmup
    progress = min((step - warmup) / max(1, total - warmup), 1.0)
    if schedule == "linear":
        return base_lr * (1.0 - progress)
    return base_lr * 0.5 * (1.0 + math.cos(math.pi * progress))


def _adamw(
    params: list[tuple[str, nn.Parameter]], lr: float, weight_decay: float, fused: bool
) -> torch.optim.AdamW:
    """AdamW, betas 0.9/0.95, no weight decay on 1-d parameters (norms)."""
    return torch.optim.AdamW(
        [
            {"params": [p for _, p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for _, p in params if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=lr,
        betas=(0.9, 0.95),
        fused=True if fused else None,
    )


def make_optimizer(
    model: nn.Module,
    lr: float,
    weight_decay: float,
    fused: bool = False,
    kind: str = "adamw",
    muon_weight_decay: float = 0.1,
) -> torch.optim.Optimizer | MuonAdamW:
    """The optimizer of ``train.optimizer``. ``fused``: AdamW in one kernel (CUDA; same state
    names and maths, so checkpoints move between both)."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if kind == "adamw":
        return _adamw(params, lr, weight_decay, fused)
    if kind != "muon":
        raise ValueError(f"unknown optimizer {kind!r} (adamw or muon)")
    is_matrix = [
        p.dim() == 2 and min(p.shape) > 1 and not any(h in n for h in ADAMW_ONLY) for n, p in params
    ]
    matrices = [p for (_, p), m in zip(params, is_matrix) if m]
    rest = [(n, p) for (n, p), m in zip(params, is_matrix) if not m]
    muon = torch.optim.Muon(
        matrices, lr=lr, weight_decay=muon_weight_decay, adjust_lr_fn="match_rms_adamw"
    )
    return MuonAdamW(muon, _adamw(rest, lr, weight_decay, fused))


class MuonAdamW:
    """Two optimizers stepped as one. ``param_groups`` is both lists (the schedule sets every
    group's lr); ``state_dict`` numbers the parameters across both, in order, like one
    optimizer's, so the checkpoint writes and resumes it unchanged."""

    def __init__(self, muon: torch.optim.Optimizer, adamw: torch.optim.Optimizer) -> None:
        self.parts = (muon, adamw)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for o in self.parts for g in o.param_groups]

    def step(self) -> None:
        for o in self.parts:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.parts:
            o.zero_grad(set_to_none=set_to_none)

    def _sizes(self) -> list[int]:
        return [sum(len(g["params"]) for g in o.param_groups) for o in self.parts]

    def state_dict(self) -> dict[str, Any]:
        state: dict[int, Any] = {}
        groups: list[dict[str, Any]] = []
        offset = 0
        for o, n in zip(self.parts, self._sizes()):
            sd = o.state_dict()
            state.update({offset + i: s for i, s in sd["state"].items()})
            groups += [
                {**g, "params": [offset + i for i in g["params"]]} for g in sd["param_groups"]
            ]
            offset += n
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        offset, first = 0, 0
        for o, n in zip(self.parts, self._sizes()):
            k = len(o.param_groups)
            groups = [
                {**g, "params": [i - offset for i in g["params"]]}
                for g in sd["param_groups"][first : first + k]
            ]
            state = {i - offset: s for i, s in sd["state"].items() if offset <= i < offset + n}
            o.load_state_dict({"state": state, "param_groups": groups})
            offset, first = offset + n, first + k
