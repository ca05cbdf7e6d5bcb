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
4. report.json / report.md / report.png, the gate, and promotion of a passing draft with its
   serving config (``serving.json``: the speculative config of its best k per concurrency).

With ``verify.num_speculative_tokens`` a list, steps 1-2 are a k sweep (``eagle3.verify.sweep``):
the baseline, the offline estimate at every k, then the draft and the n-gram at the largest k and
at the predicted best; the rest of the report is made at each method's best measured k.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from eagle3.atomic import write_json_atomic, write_text_atomic
from eagle3.serving.units import speculative_config
from eagle3.tracking import track_verify
from eagle3.verify.arms import (
    Arms,
    Sweeps,
    chosen_ks,
    measure_arms,
    measure_sweep,
    point_candidate,
    tokens_per_s,
    with_k,
)
from eagle3.verify.client import WorkloadRun
from eagle3.verify.compare import add_baseline_drift, compare_windows, outputs_summary
from eagle3.verify.gate import GateFailed, GateResult, evaluate_gate, last_promoted, promote
from eagle3.verify.ngram_baseline import ngram_section, versus_ngram
from eagle3.verify.offline import offline_acceptance
from eagle3.verify.plot import plot
from eagle3.verify.report import render_markdown
from eagle3.verify.sweep import (
    MethodSweep,
    serving_recommendation,
)
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
    _require_draft(draft_dir)
    started = time.time()
    convs = load_workload(v.workload, v.num_prompts, v.turns, v.mix_categories)
    fp = workload_fingerprint(convs)
    log(
        f"verify: {len(convs)} conversations x {v.turns} turns, concurrency {v.concurrency}, "
        f"k={v.num_speculative_tokens}" + (", then the n-gram baseline" if v.ngram_baseline else "")
    )
    cats = {c.id: c.category or "-" for c in convs}
    arms, sweeps, offline = _measure(cfg, model, draft_dir, convs, out_dir, cats, log, on_progress)
    k_draft, k_ngram, parallel = chosen_ks(cfg, sweeps)
    cfg_d, cfg_n = with_k(cfg, k_draft), with_k(cfg, k_ngram)
    results = _compare(cfg_d, cfg_n, model, draft_dir, out_dir, arms, log, cats, offline)
    sweeps = sweeps or _single(cfg, arms, results)  # one k: the "sweep" is what was measured
    base_tps = tokens_per_s(arms.base)
    draft_sweep, ngram_sweep, parallel_sweep = sweeps
    spec = partial(speculative_config, cfg, str(draft_dir))
    serving = serving_recommendation(draft_sweep, ngram_sweep, base_tps, spec, parallel_sweep)
    conditions = _conditions(v, fp, k_draft, sweeps[0])
    gate = _gate(cfg, results, conditions)
    report: dict[str, Any] = {
        "stage": "verify",
        "profile": cfg.name,
        "target": model,
        "draft_dir": str(draft_dir),
        "num_speculative_tokens": k_draft,
        "parallel_drafting": parallel,
        "temperature": v.temperature,
        "max_tokens": v.max_tokens,
        "workload": {
            "name": v.workload,
            "conversations": len(convs),
            "turns": v.turns,
            "fingerprint": fp,
        },
        **results,
        "sweep": _sweep_section(v.ks, sweeps, base_tps, k_ngram),
        "serving": serving,
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
        report["promoted"] = _promote(cfg, draft_dir, out_dir, conditions, results, fp, serving)
    report["wall_s"] = round(time.time() - started, 2)
    _write_report(out_dir, report)
    track_verify(cfg, out_dir, report)  # TensorBoard (tracking.tensorboard), a failed gate too
    if not gate.passed:
        raise GateFailed(
            f"verify gate failed for {draft_dir}: "
            + "; ".join(gate.reasons)
            + f" (report: {out_dir / 'report.md'}); the draft was not promoted"
        )
    return report


def _require_draft(draft_dir: Path) -> None:
    if not (draft_dir / "config.json").is_file():
        raise FileNotFoundError(
            f"{draft_dir}: no exported draft (config.json missing): run the train stage"
        )


def _conditions(v: Any, fp: str, k_draft: int, draft_sweep: MethodSweep) -> dict[str, Any]:
    """What the gate compares the next draft under (stored with the promoted draft)."""
    return {
        "workload_fingerprint": fp,
        "num_speculative_tokens": k_draft,
        "temperature": v.temperature,
        "max_tokens": v.max_tokens,
        # vLLM's acceptance length at every k served: the next draft is compared with this one
        # at a k both served, even where their best k differ
        "acceptance_by_k": {str(k): a for k, a in draft_sweep.served_acceptance.items()},
    }


def _sweep_section(
    ks: list[int],
    sweeps: Sweeps,
    base_tps: dict[int, float],
    k_ngram: int,
) -> dict[str, Any]:
    return {
        "ks": ks,
        "draft": sweeps[0].to_dict(),
        "ngram": sweeps[1].to_dict() if sweeps[1] else None,
        "parallel": sweeps[2].to_dict() if sweeps[2] else None,
        "baseline_tokens_per_s": {str(c): t for c, t in base_tps.items()},
        "ngram_num_speculative_tokens": k_ngram,
    }


def _measure(
    cfg: Any,
    model: str,
    draft_dir: Path,
    convs: list,
    out_dir: Path,
    categories: dict[str, str],
    log: Callable[[str], None],
    on_progress: Callable[[str, int, int, int], None] | None,
) -> tuple[Arms, Sweeps | None, dict[str, Any] | None]:
    """The servers: one k (three arms), or a k sweep with the offline estimate at every k."""
    v = cfg.verify
    if len(v.ks) == 1:
        spec = speculative_config(cfg, str(draft_dir))
        return measure_arms(cfg, model, spec, convs, out_dir / "logs", log, on_progress), None, None

    def estimate(brun: WorkloadRun, parallel: bool) -> dict[str, Any] | None:
        if not (v.offline_estimate and v.temperature == 0 and Path(model).is_dir()):
            return None
        return _offline(cfg, model, draft_dir, brun, v.k, v.ks, categories, log, parallel)

    return measure_sweep(cfg, model, draft_dir, convs, out_dir / "logs", log, on_progress, estimate)


def _single(cfg: Any, arms: Arms, results: dict[str, Any]) -> Sweeps:
    """A single-k verify as a one-point sweep (the serving recommendation has one k)."""
    k = cfg.verify.k
    draft = MethodSweep("draft", [k], {k: results["acceptance_length"] or 1.0})
    draft.measured, draft.served = {k: tokens_per_s(arms.spec)}, [k]
    if results["acceptance_length"] is not None:
        draft.served_acceptance = {k: results["acceptance_length"]}
    ngram = None
    if arms.ngram:
        ngram = MethodSweep("ngram", [k], {})
        ngram.measured, ngram.served = {k: tokens_per_s(arms.ngram)}, [k]
    return draft, ngram, None


def _compare(
    cfg: Any,
    cfg_ngram: Any,
    model: str,
    draft_dir: Path,
    out_dir: Path,
    arms: Arms,
    log: Callable[[str], None],
    categories: dict[str, str],
    offline: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The measured part of the report, in its order: acceptance (the speculative server's
    counters over every window), speedups, windows, greedy outputs, the offline estimate, the
    n-gram baseline and the draft against it. Also writes every window's outputs.

    ``cfg`` carries the draft's k, ``cfg_ngram`` the n-gram's (they differ after a sweep);
    ``offline``: the sweep's offline estimate (every k), reported at the draft's k."""
    v = cfg.verify
    greedy = v.temperature == 0
    windows, total = compare_windows(arms.base, arms.spec, greedy)
    if greedy and len(arms.base) > 1:
        add_baseline_drift(windows, arms.base)
    _save_all_outputs(out_dir / "outputs", arms)
    acceptance = total.summary()
    outputs = outputs_summary(windows, greedy)
    brun = arms.base[0][0]
    if offline is not None:
        offline = {**offline, **offline["by_k"][v.k]}
    elif v.offline_estimate and greedy and Path(model).is_dir():
        offline = _offline(cfg, model, draft_dir, brun, v.k, (), categories, log)
    if offline is not None:
        _offline_vs_vllm(offline, brun.concurrency, windows, log)
    ngram = ngram_section(
        cfg_ngram, windows, arms.base, arms.ngram, arms.ngram_info, arms.ngram_reason
    )
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


def _offline(
    cfg: Any,
    model: str,
    draft_dir: Path,
    brun: WorkloadRun,
    k: int,
    ks: Any,
    categories: dict[str, str],
    log: Callable[[str], None],
    parallel: bool = False,
) -> dict[str, Any]:
    """The offline PyTorch estimate on a baseline window's outputs (every k of ``ks`` from one
    pass; per workload category; ``parallel``: of the draft served with parallel drafting)."""
    v = cfg.verify
    t0 = time.time()
    offline = offline_acceptance(
        model,
        draft_dir,
        [(r.prompt_token_ids, r.token_ids) for r in brun.results],
        k,
        max_sequences=v.offline_max_sequences,
        ngram_lookup=(v.ngram_prompt_lookup_min, v.ngram_prompt_lookup_max),
        ks=ks,
        groups=[categories.get(r.conversation, "-") for r in brun.results],
        parallel=parallel,
    )
    offline["parallel_drafting"] = parallel
    offline["wall_s"] = round(time.time() - t0, 2)
    offline["on_concurrency"] = brun.concurrency
    log(
        f"verify: offline estimate{' (parallel drafting)' if parallel else ''} "
        f"{offline['acceptance_length']} at k={k}"
        + (
            " (every k: "
            + ", ".join(f"{kk}: {o['acceptance_length']:.3f}" for kk, o in offline["by_k"].items())
            + ")"
            if ks
            else ""
        )
        + "; n-gram simulated on the same sequences "
        + str((offline.get("ngram") or {}).get("acceptance_length"))
    )
    return offline


def _offline_vs_vllm(
    offline: dict[str, Any],
    concurrency: int,
    windows: list[dict[str, Any]],
    log: Callable[[str], None],
) -> None:
    """vLLM's acceptance length on the same prompts (the window of the estimate's concurrency)
    next to the estimate."""
    same = next(w for w in windows if w["concurrency"] == concurrency)["speculative"][
        "acceptance_length"
    ]
    offline["vllm_acceptance_length_same_prompts"] = same
    offline["difference_from_vllm"] = (
        offline["acceptance_length"] - same
        if offline["acceptance_length"] is not None and same is not None
        else None
    )
    log(f"verify: offline estimate {offline['acceptance_length']} vs vLLM {same} (same prompts)")


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
    serving: dict[str, Any],
) -> str:
    """Promote the passing draft with its serving config; returns where it now lies."""
    dest = promote(
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
    write_serving_config(dest, serving, conditions)
    return str(dest)


def write_serving_config(dest: Path, serving: dict[str, Any], conditions: dict[str, Any]) -> Path:
    """``serving.json`` in the promoted draft's folder: per concurrency, the
    ``--speculative-config`` of the best measured k pointing at this folder (what ``vllm
    serve`` and the systemd unit take), with the tokens/s and speedup it measured and the
    n-gram baseline at its own best k."""
    by_c = {}
    for c, e in serving.items():
        spec = {**e["speculative_config"], "model": str(dest)}
        by_c[c] = {
            **e,
            "speculative_config": spec,
            "vllm_args": ["--speculative-config", json.dumps(spec)],
        }
    lowest = min(by_c, key=int)
    doc = {
        "recommended": {"concurrency": int(lowest), **by_c[lowest]},
        "by_concurrency": by_c,
        "measured_on": conditions,
    }
    write_json_atomic(dest / "serving.json", doc)
    return dest / "serving.json"


def _write_report(out_dir: Path, report: dict[str, Any]) -> None:
    write_json_atomic(out_dir / "report.json", report)
    write_text_atomic(out_dir / "report.md", render_markdown(report))
    plot(report, out_dir / "report.png")
