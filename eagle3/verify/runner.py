"""Verify stage: does the draft make the served target faster, by how much, and is it better
than the last promoted one.

1. The target alone (baseline), then target + draft (``--speculative-config`` method eagle3),
   then (``verify.ngram_baseline``) target + prompt lookup (method ngram: the free baseline a
   draft must beat), one after the other through the serve stage, same settings otherwise
   (``eagle3.verify.arms``).
2. The same workload on each, at every configured concurrency; around each measured window a
   ``/metrics`` snapshot, so acceptance comes from vLLM's own counters (deltas) and latency from
   its histograms; throughput from the client's clock (``eagle3.verify.compare``,
   ``eagle3.verify.ngram_baseline``).
3. Greedy outputs compared token for token; the offline PyTorch estimate on the baseline's
   outputs.
4. report.json / report.md / report.png, the gate, and promotion of a passing draft.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from eagle3.atomic import write_json_atomic, write_text_atomic
from eagle3.serving.units import speculative_config
from eagle3.verify.arms import Arms, measure_arms, point_candidate
from eagle3.verify.client import WorkloadRun
from eagle3.verify.compare import add_baseline_drift, compare_windows, outputs_summary
from eagle3.verify.gate import GateFailed, GateResult, evaluate_gate, last_promoted, promote
from eagle3.verify.ngram_baseline import ngram_section, versus_ngram
from eagle3.verify.offline import offline_acceptance
from eagle3.verify.report import plot, render_markdown
from eagle3.verify.workload import load_workload, workload_fingerprint

# point_candidate, ngram_section and versus_ngram moved out; still importable from here
__all__ = ["point_candidate", "ngram_section", "save_outputs", "verify", "versus_ngram"]


def save_outputs(path: Path, run: WorkloadRun) -> None:
    """Every turn's token ids and text (for the mismatch details and the offline estimate)."""
    write_text_atomic(path, "".join(json.dumps(r.to_dict()) + "\n" for r in run.results))


def verify(
    cfg: Any,
    model: str,
    draft_dir: str | Path,
    out_dir: str | Path,
    *,
    log: Callable[[str], None] = print,
    on_progress: Callable[[str, int, int, int], None] | None = None,
) -> dict[str, Any]:
    """Run the verify stage; returns the report (also written to ``out_dir``). Raises
    :class:`GateFailed` after writing the report when the gate fails."""
    v = cfg.verify
    draft_dir, out_dir = Path(draft_dir).resolve(), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if not (draft_dir / "config.json").is_file():
        raise FileNotFoundError(
            f"{draft_dir}: no exported draft (config.json missing): run the train stage"
        )
    started = time.time()
    convs = load_workload(v.workload, v.num_prompts, v.turns)
    fp = workload_fingerprint(convs)
    spec = speculative_config(cfg, str(draft_dir))
    log(
        f"verify: {len(convs)} conversations x {v.turns} turns, concurrency {v.concurrency}, "
        f"k={v.num_speculative_tokens}" + (", then the n-gram baseline" if v.ngram_baseline else "")
    )
    arms = measure_arms(cfg, model, spec, convs, out_dir / "logs", log, on_progress)
    results = _compare(cfg, model, draft_dir, out_dir, arms, log)
    conditions = {
        "workload_fingerprint": fp,
        "num_speculative_tokens": v.num_speculative_tokens,
        "temperature": v.temperature,
        "max_tokens": v.max_tokens,
    }
    gate = _gate(cfg, results, conditions)
    report: dict[str, Any] = {
        "stage": "verify",
        "profile": cfg.name,
        "target": model,
        "draft_dir": str(draft_dir),
        "num_speculative_tokens": v.num_speculative_tokens,
        "temperature": v.temperature,
        "max_tokens": v.max_tokens,
        "workload": {
            "name": v.workload,
            "conversations": len(convs),
            "turns": v.turns,
            "fingerprint": fp,
        },
        **results,
        "gate": gate.to_dict(),
        "promoted": None,
        "servers": {
            "baseline": arms.base_info,
            "speculative": arms.spec_info,
            "ngram": arms.ngram_info,
        },
        "wall_s": None,
    }
    if gate.passed and v.promote:
        report["promoted"] = _promote(cfg, draft_dir, out_dir, conditions, results, fp)
    report["wall_s"] = round(time.time() - started, 2)
    _write_report(out_dir, report)
    if not gate.passed:
        raise GateFailed(
            f"verify gate failed for {draft_dir}: "
            + "; ".join(gate.reasons)
            + f" (report: {out_dir / 'report.md'}); the draft was not promoted"
        )
    return report


def _compare(
    cfg: Any,
    model: str,
    draft_dir: Path,
    out_dir: Path,
    arms: Arms,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """The measured part of the report, in its order: acceptance (the speculative server's
    counters over every window), speedups, windows, greedy outputs, the offline estimate, the
    n-gram baseline and the draft against it. Also writes every window's outputs."""
    v = cfg.verify
    greedy = v.temperature == 0
    windows, total = compare_windows(arms.base, arms.spec, greedy)
    if greedy and len(arms.base) > 1:
        add_baseline_drift(windows, arms.base)
    _save_all_outputs(out_dir / "outputs", arms)
    acceptance = total.summary()
    outputs = outputs_summary(windows, greedy)
    offline = None
    if v.offline_estimate and greedy and Path(model).is_dir():
        offline = _offline_estimate(cfg, model, draft_dir, arms.base, windows, acceptance, log)
    ngram = ngram_section(cfg, windows, arms.base, arms.ngram, arms.ngram_info, arms.ngram_reason)
    versus = versus_ngram(acceptance["acceptance_length"], windows, ngram)
    if ngram["measured"]:
        log(
            f"verify: n-gram baseline acceptance length {ngram['acceptance_length']} "
            f"(vLLM, proposing steps), {ngram['acceptance_length_all_steps']} over all steps; "
            f"speedup {ngram['speedup']}"
        )
    return {
        "acceptance": {**acceptance, "counters": total.raw()},
        "acceptance_length": acceptance["acceptance_length"],
        "speedup": {str(w["concurrency"]): w["speedup"] for w in windows},
        "windows": windows,
        "outputs": outputs,
        "offline": offline,
        "ngram": ngram,
        "versus_ngram": versus,
    }


def _save_all_outputs(out: Path, arms: Arms) -> None:
    """``outputs/<arm>-c<concurrency>.jsonl`` for every measured window."""
    for label, runs in (
        ("baseline", arms.base),
        ("speculative", arms.spec),
        ("ngram", arms.ngram or []),
    ):
        for run, _, _ in runs:
            save_outputs(out / f"{label}-c{run.concurrency}.jsonl", run)


def _offline_estimate(
    cfg: Any,
    model: str,
    draft_dir: Path,
    base: list,
    windows: list[dict[str, Any]],
    acceptance: dict[str, Any],
    log: Callable[[str], None],
) -> dict[str, Any]:
    """The offline PyTorch estimate on the first baseline window's outputs, next to vLLM's
    acceptance length on the same prompts."""
    v = cfg.verify
    brun = base[0][0]
    seqs = [(r.prompt_token_ids, r.token_ids) for r in brun.results]
    t0 = time.time()
    offline = offline_acceptance(
        model,
        draft_dir,
        seqs,
        v.num_speculative_tokens,
        max_sequences=v.offline_max_sequences,
        ngram_lookup=(v.ngram_prompt_lookup_min, v.ngram_prompt_lookup_max),
    )
    offline["wall_s"] = round(time.time() - t0, 2)
    offline["on_concurrency"] = brun.concurrency
    al = acceptance["acceptance_length"]
    # compare with vLLM on the same prompts: the window of the same concurrency
    same = next(w for w in windows if w["concurrency"] == brun.concurrency)["speculative"][
        "acceptance_length"
    ]
    offline["vllm_acceptance_length_same_prompts"] = same
    offline["difference_from_vllm"] = (
        offline["acceptance_length"] - same
        if offline["acceptance_length"] is not None and same is not None
        else None
    )
    log(
        f"verify: offline estimate {offline['acceptance_length']} vs vLLM {same} "
        f"(all windows {al}); n-gram simulated on the same sequences "
        f"{(offline.get('ngram') or {}).get('acceptance_length')}"
    )
    return offline


def _gate(cfg: Any, results: dict[str, Any], conditions: dict[str, Any]) -> GateResult:
    """The gate against the thresholds and the last promoted draft of this profile."""
    v = cfg.verify
    prev = last_promoted(cfg.paths.runs_dir, cfg.name)
    return evaluate_gate(
        results["acceptance_length"],
        conditions,
        prev,
        min_acceptance_length=v.min_acceptance_length,
        max_regression=v.max_regression,
        mismatch_fraction=results["outputs"]["mismatch_fraction"],
        max_mismatch_fraction=v.max_mismatch_fraction,
        require_beat_ngram=v.require_beat_ngram,
        versus_ngram=results["versus_ngram"],
        ngram_reason=results["ngram"].get("reason"),
    )


def _promote(
    cfg: Any,
    draft_dir: Path,
    out_dir: Path,
    conditions: dict[str, Any],
    results: dict[str, Any],
    fp: str,
) -> str:
    """Promote the passing draft; returns where it now lies."""
    return str(
        promote(
            draft_dir,
            cfg.paths.runs_dir,
            cfg.name,
            {
                **conditions,
                "acceptance_length": results["acceptance_length"],
                "report": str(out_dir / "report.json"),
                "key": fp[:8],
            },
        )
    )


def _write_report(out_dir: Path, report: dict[str, Any]) -> None:
    write_json_atomic(out_dir / "report.json", report)
    write_text_atomic(out_dir / "report.md", render_markdown(report))
    plot(report, out_dir / "report.png")
