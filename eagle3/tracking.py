"""TensorBoard event files for the train and verify stages (``tracking.tensorboard``).

A training person watches curves live in the tracker they already use; TensorBoard needs no
account and no server beyond itself. Every run of a profile writes under one log dir,
``<run dir>/tensorboard/`` (``runs/<profile>/tensorboard``), one sub-folder per stage run named
``<stage>-<UTC start>-<key>``: sorted by name they are in time order, so tonight's draft sits next
to last night's in the same charts (``eagle3 tensorboard`` / ``make tensorboard`` serve the log
dir). A resumed run (same stage folder) writes into its first sub-folder, steps continuing.

Train: per logging step (``tracking.every_steps``) the loss and top-1 of each TTT position, lr,
grad norm, loss tokens/s, model TFLOP/s (eagle3/train/flops.py) and, on a GPU whose bf16
peak is known, MFU; per epoch the same means, the epoch's seconds and, online, where its
states came from; at the end, online, the step's wait for states and the producer's time. Verify:
acceptance per position, per workload category (the offline estimate) and tokens/s per method at
each k (x axis: the position, or k).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Progress = Callable[[dict[str, Any]], None]


@dataclass
class Tracker:
    """One stage run's event writer; with no writer (tracking off, not rank 0) it does nothing."""

    writer: Any = None
    every: int = 1
    log_dir: Path | None = None
    _last: float | None = None  # when the previous step's metrics arrived (tokens/s)
    flops: float | None = None  # model FLOPs per token of the step (eagle3/train/flops.py)
    peak: float | None = None  # a GPU's dense bf16 peak FLOP/s, where known (MFU)
    world: int = 1  # ranks sharing the step's tokens

    def set_flops(self, flops: float, peak: float | None, world: int = 1) -> None:
        self.flops, self.peak, self.world = flops, peak, world

    def scalar(self, tag: str, value: float | None, step: int) -> None:
        if self.writer is not None and value is not None:
            self.writer.add_scalar(tag, float(value), step)

    def wrap(self, on_progress: Progress | None) -> Progress | None:
        """``on_progress`` that also logs the step (the train stage's per-step dict)."""
        if self.writer is None:
            return on_progress

        def both(p: dict[str, Any]) -> None:
            self.train_step(p)
            if on_progress is not None:
                on_progress(p)

        return both

    def train_step(self, p: dict[str, Any]) -> None:
        """One optimizer step (eagle3.train.progress.StepQueue's dict); tokens/s is the loss
        tokens of this rank's step over the time since the previous step's metrics arrived."""
        now, last, self._last = time.monotonic(), self._last, time.monotonic()
        step = p["step"]
        if self.writer is None or (step % self.every and step != p.get("total_steps")):
            return
        self.scalar("train/loss", p.get("loss"), step)
        self.scalar("train/lr", p.get("lr"), step)
        self.scalar("train/grad_norm", p.get("grad_norm"), step)
        self.scalar("train/skipped_nan", p.get("skipped_nan"), step)
        stats = p.get("steps") or []
        for i, st in enumerate(stats):
            self.scalar(f"train/loss_pos{i}", st.get("loss"), step)
            if st.get("count"):
                self.scalar(f"train/top1_pos{i}", st["correct"] / st["count"], step)
        if stats and last is not None and now > last:
            self.scalar("train/tokens_per_s", stats[0].get("count", 0) / (now - last), step)
        if self.flops and p.get("tokens") and last is not None and now > last:
            # a GPU's model FLOP/s: its share of the step's real tokens (padding counts nothing)
            flop_s = p["tokens"] / self.world / (now - last) * self.flops
            self.scalar("train/model_tflops_per_s", flop_s / 1e12, step)
            if self.peak:
                self.scalar("train/mfu", flop_s / self.peak, step)

    def train_epoch(self, e: dict[str, Any]) -> None:
        """One entry of metrics.json (x axis: the epoch)."""
        n = e["epoch"]
        names = e.get("columns") or []
        for i, (loss, top1) in enumerate(zip(e.get("loss", []), e.get("top1", []))):
            tag = column_tag(names[i]) if i < len(names) else f"pos{i}"
            self.scalar(f"epoch/loss_{tag}", loss, n)
            self.scalar(f"epoch/top1_{tag}", top1, n)
        self.scalar("epoch/seconds", e.get("s"), n)
        if e.get("s"):
            self.scalar("epoch/tokens_per_s", e.get("tokens", 0) / e["s"], n)
        for source, count in (e.get("states") or {}).items():
            self.scalar(f"epoch/states_{source}", count, n)
        for part, seconds in (e.get("time") or {}).items():  # where the epoch's seconds went
            self.scalar(f"epoch/time_{part}", seconds, n)
        self.flush()

    def train_end(self, manifest: dict[str, Any]) -> None:
        """The run's totals: loop seconds and, online, the step's wait and the producer's time."""
        step = manifest.get("steps") or 0
        self.scalar("train/loop_s", manifest.get("loop_s"), step)
        states = manifest.get("states") or {}
        for name in ("step_wait_s", "produce_s"):
            self.scalar(f"train/states_{name}", states.get(name), step)
        self.close()

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def column_tag(name: str) -> str:
    """A loss column's TensorBoard tag: ``step 2`` -> ``pos2`` (the TTT step, as before parallel
    drafting), ``parallel 1`` -> ``par1`` (eagle3.train.ttt.column_names)."""
    kind, _, i = name.partition(" ")
    return f"{'par' if kind == 'parallel' else 'pos'}{i}"


def run_log_dir(cfg: Any, stage: str, out_dir: Path) -> Path:
    """``<run dir>/tensorboard/<stage>-<UTC start>-<key>``: the stage folder's name is its key;
    an existing sub-folder of that key (a resumed run) is reused. A folder outside the profile's
    run dir (a CLI ``--out``, a test) keeps its events in ``<out_dir>/tensorboard``."""
    out_dir = Path(out_dir).resolve()
    run_dir = Path(cfg.paths.run_dir).resolve()
    root = run_dir / "tensorboard" if out_dir.is_relative_to(run_dir) else out_dir / "tensorboard"
    key = re.sub(r"[^A-Za-z0-9_.-]", "_", out_dir.name)[:8]  # the key's first 8 hex digits
    existing = sorted(root.glob(f"{stage}-*-{key}"))
    if existing:
        return existing[-1]
    return root / f"{stage}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{key}"


def open_tracker(cfg: Any, stage: str, out_dir: Path, main: bool = True) -> Tracker:
    """The stage's tracker: writing when ``tracking.tensorboard`` is on and this is rank 0."""
    t = cfg.tracking
    if not (t.tensorboard and main):
        return Tracker()
    from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

    log_dir = run_log_dir(cfg, stage, out_dir)
    # flushed every 10 s (not TensorBoard's 120): a person watches the curves as it trains
    return Tracker(SummaryWriter(str(log_dir), flush_secs=10), t.every_steps, log_dir)


def open_train_tracker(
    cfg: Any, out_dir: Path, main: bool, model: Any, ds: Any, device: Any, world: int
) -> Tracker:
    """The train stage's tracker, with the step's model FLOPs per token and the GPU's peak
    (model TFLOP/s and MFU beside tokens/s)."""
    from eagle3.train.flops import peak_flops, run_flops_per_token

    tr = open_tracker(cfg, "train", out_dir, main)
    if tr.writer is not None:
        tr.set_flops(run_flops_per_token(model, cfg.train, ds), peak_flops(device), world)
    return tr


def track_verify(cfg: Any, out_dir: Path, report: dict[str, Any]) -> Path | None:
    """Verify's scalars from its report: acceptance per position (x: position), per category
    (the offline estimate's, x: k) and tokens/s per method and concurrency (x: k)."""
    tr = open_tracker(cfg, "verify", out_dir)
    if tr.writer is None:
        return None
    k = report.get("num_speculative_tokens") or 0
    tr.scalar("verify/acceptance_length", report.get("acceptance_length"), k)
    per_pos = (report.get("acceptance") or {}).get("acceptance_per_position") or []
    for i, a in enumerate(per_pos):
        tr.scalar("verify/acceptance_per_position", a, i)
    ngram = report.get("ngram") or {}
    tr.scalar("verify/ngram_acceptance_length", ngram.get("acceptance_length_all_steps"), k)
    for cat, g in ((report.get("offline") or {}).get("by_group") or {}).items():
        tag = re.sub(r"[^A-Za-z0-9_]", "_", str(cat))
        tr.scalar(f"verify/category_{tag}/acceptance_length", g.get("acceptance_length"), k)
        for i, a in enumerate(g.get("acceptance_per_position") or []):
            tr.scalar(f"verify/category_{tag}/acceptance_per_position", a, i)
    sweep = report.get("sweep") or {}
    for method in ("draft", "ngram"):
        measured = (sweep.get(method) or {}).get("measured_tokens_per_s") or {}
        for kk, by_c in measured.items():
            for c, tps in by_c.items():
                tr.scalar(f"verify/tokens_per_s_{method}_c{c}", tps, int(kk))
    for c, tps in (sweep.get("baseline_tokens_per_s") or {}).items():
        tr.scalar(f"verify/tokens_per_s_target_c{c}", tps, 0)
    tr.close()
    return tr.log_dir


def tensorboard_argv(log_dir: Path, port: int) -> list[str]:
    """TensorBoard over a profile's log dir, on 127.0.0.1 only (no one else on the network)."""
    import sys

    return [sys.executable, "-m", "tensorboard.main", "--logdir", str(log_dir)] + [
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
