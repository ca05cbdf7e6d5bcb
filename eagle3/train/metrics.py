"""Per-epoch metrics: loss and top-1 agreement per TTT step and parallel depth (``metrics.json``,
``metrics.png``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eagle3.train.checkpoint import TrainState


def accumulate(state: TrainState, stats: list[dict]) -> None:
    """Add one step's per-TTT-step stats to the running sums of the epoch."""
    s = state.epoch_sums
    if not s:
        s.update(loss=[0.0] * len(stats), correct=[0.0] * len(stats), count=[0.0] * len(stats))
    for i, st in enumerate(stats):
        s["loss"][i] += st["loss"] * st["count"]
        s["correct"][i] += st["correct"]
        s["count"][i] += st["count"]


def epoch_metrics(state: TrainState, columns: list[str] | None = None) -> dict[str, Any]:
    """The finished epoch's entry of ``metrics.json`` (means over counted positions, one per loss
    column: ``columns`` names them, eagle3.train.ttt.column_names)."""
    s = state.epoch_sums or {"loss": [], "correct": [], "count": []}
    return {
        "epoch": state.epoch + 1,
        "step": state.step,
        **({"columns": columns} if columns else {}),
        "loss": [v / c if c else None for v, c in zip(s["loss"], s["count"])],
        "top1": [k / c if c else None for k, c in zip(s["correct"], s["count"])],
        "tokens": s["count"][0] if s["count"] else 0,
        "skipped_nan": state.skipped_nan,
    }


def write_metrics(out_dir: Path, history: list[dict]) -> None:
    (out_dir / "metrics.json").write_text(json.dumps({"epochs": history}, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not history:
        return
    n_steps = len(history[-1]["loss"])
    epochs = [h["epoch"] for h in history]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    names = history[-1].get("columns") or [f"step {i}" for i in range(n_steps)]
    for i in range(n_steps):
        ax1.plot(epochs, [h["loss"][i] for h in history], marker="o", label=names[i])
        ax2.plot(epochs, [h["top1"][i] for h in history], marker="o", label=names[i])
    ax1.set(xlabel="epoch", ylabel="soft CE", title="loss per TTT step")
    ax2.set(xlabel="epoch", ylabel="top-1 agreement", title="top-1 per TTT step", ylim=(0, 1))
    if n_steps:  # an epoch without one finite step has nothing to label
        ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "metrics.png", dpi=100)
    plt.close(fig)
