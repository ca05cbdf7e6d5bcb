"""Baseline vs speculative, window by window: throughput and TPOT ratios, the counters' deltas,
and (greedy) the outputs compared token for token."""

from __future__ import annotations

from typing import Any

from eagle3.verify.client import WorkloadRun, compare_outputs
from eagle3.verify.metrics import Snapshot


def window_stats(run: WorkloadRun, before: Snapshot, after: Snapshot) -> dict[str, Any]:
    """The client's figures of one window and the server's over it (counter deltas)."""
    delta = after - before
    return {
        **run.client_stats(),
        **delta.summary(),
        "counters": {"before": before.raw(), "after": after.raw()},
    }


def compare_windows(base: list, specw: list, greedy: bool) -> tuple[list[dict[str, Any]], Snapshot]:
    """One entry per concurrency, and the speculative server's counters summed over them."""
    windows = []
    total = Snapshot()
    for (brun, b0, b1), (srun, s0, s1) in zip(base, specw):
        bs, ss = window_stats(brun, b0, b1), window_stats(srun, s0, s1)
        total = total + (s1 - s0)
        bt, st = bs["output_tokens_per_s"], ss["output_tokens_per_s"]
        btp, stp = bs["server_mean_tpot_s"], ss["server_mean_tpot_s"]
        windows.append(
            {
                "concurrency": brun.concurrency,
                "baseline": bs,
                "speculative": ss,
                "speedup": st / bt if bt and st else None,
                "tpot_ratio": btp / stp if btp and stp else None,
                "outputs": compare_outputs(brun, srun) if greedy else None,
            }
        )
    return windows, total


def add_baseline_drift(windows: list[dict[str, Any]], base: list) -> None:
    """The same server at another concurrency: how much greedy output moves with batch shapes
    alone (bf16 GEMMs of other shapes round differently). Spec-vs-baseline mismatches at about
    this level are numerics, not speculation."""
    ref = base[0][0]
    for w, (brun, _, _) in zip(windows[1:], base[1:]):
        w["baseline_vs_first_window"] = {
            k: v for k, v in compare_outputs(ref, brun).items() if k != "details"
        }


def outputs_summary(windows: list[dict[str, Any]], greedy: bool) -> dict[str, Any]:
    """Greedy mismatches summed over the windows."""
    compared = sum(w["outputs"]["compared"] for w in windows) if greedy else 0
    mism = sum(w["outputs"]["mismatches"] for w in windows) if greedy else 0
    return {
        "compared": compared,
        "mismatches": mism,
        "mismatch_fraction": mism / compared if compared else None,
        "greedy": greedy,
    }
