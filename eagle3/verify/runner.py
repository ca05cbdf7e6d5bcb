"""Verify stage: does the draft make the served target faster, by how much, and is it better
than the last promoted one.

1. The target alone (baseline), then target + draft (``--speculative-config`` method eagle3), then
   (``verify.ngram_baseline``) target + prompt lookup (method ngram: the free baseline a draft must
   beat), one after the other through the serve stage, same settings otherwise.
2. The same workload on each, at every configured concurrency; around each measured window a
   ``/metrics`` snapshot, so acceptance comes from vLLM's own counters (deltas) and latency from
   its histograms; throughput from the client's clock.
3. Greedy outputs compared token for token; the offline PyTorch estimate on the baseline's outputs.
4. report.json / report.md / report.png, the gate, and promotion of a passing draft.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from eagle3.atomic import replace_symlink, write_json_atomic, write_text_atomic
from eagle3.serving.gpus import release_gpus
from eagle3.serving.server import Server, start_server
from eagle3.serving.units import speculative_config
from eagle3.verify.client import WorkloadRun, compare_outputs, run_workload, warmup
from eagle3.verify.gate import GateFailed, evaluate_gate, last_promoted, promote
from eagle3.verify.metrics import Snapshot, snapshot
from eagle3.verify.ngram import simulate_ngram, vllm_ngram_config
from eagle3.verify.offline import offline_acceptance
from eagle3.verify.report import plot, render_markdown
from eagle3.verify.workload import Conversation, load_workload, workload_fingerprint


def point_candidate(link: Path, draft_dir: Path) -> None:
    """Atomically point ``link`` (named by the speculative unit) at the draft under test."""
    replace_symlink(link, draft_dir)


def _speculative_server(cfg: Any, model: str, spec: dict[str, Any], log_dir: Path) -> Server:
    s = cfg.serve
    v = cfg.verify
    if s.backend == "external":
        if not v.speculative_base_url:
            raise ValueError(
                "serve.backend external: set verify.speculative_base_url to the server running "
                f"target + draft with --speculative-config '{spec}'"
            )
        serve = s.model_copy(update={"base_url": v.speculative_base_url})
        return start_server(cfg.model_copy(update={"serve": serve}), model)
    if s.backend == "systemd":
        if not v.speculative_unit:
            raise ValueError(
                "serve.backend systemd: set verify.speculative_unit to a unit serving target + draft "
                f"(its ExecStart needs --speculative-config '{spec}')"
            )
        point_candidate(Path(v.candidate_link), Path(spec["model"]))
        serve = s.model_copy(update={"unit": v.speculative_unit})
        return start_server(cfg.model_copy(update={"serve": serve}), model)
    return start_server(cfg, model, speculative_config=spec, log_dir=log_dir)


def ngram_speculative_config(cfg: Any) -> dict[str, Any]:
    """The ``--speculative-config`` of the n-gram baseline server (same k as the draft)."""
    v = cfg.verify
    return vllm_ngram_config(
        v.num_speculative_tokens, v.ngram_prompt_lookup_min, v.ngram_prompt_lookup_max
    )


def _ngram_server(cfg: Any, model: str, spec: dict[str, Any], log_dir: Path) -> Server | str:
    """The n-gram baseline server, or why it is not measured (a backend that starts no process
    needs its address or unit; the baseline is optional, so a missing one is reported, not fatal)."""
    s = cfg.serve
    v = cfg.verify
    flag = f"--speculative-config '{json.dumps(spec)}'"
    if s.backend == "external":
        if not v.ngram_base_url:
            return f"serve.backend external: no verify.ngram_base_url (a server running the target with {flag})"
        serve = s.model_copy(update={"base_url": v.ngram_base_url})
        return start_server(cfg.model_copy(update={"serve": serve}), model)
    if s.backend == "systemd":
        if not v.ngram_unit:
            return f"serve.backend systemd: no verify.ngram_unit (a unit whose ExecStart carries {flag})"
        serve = s.model_copy(update={"unit": v.ngram_unit})
        return start_server(cfg.model_copy(update={"serve": serve}), model)
    return start_server(cfg, model, speculative_config=spec, log_dir=log_dir)


def measure(
    server: Server,
    convs: list[Conversation],
    cfg: Any,
    label: str,
    on_result: Callable[[str, int, int, int], None] | None = None,
) -> list[tuple[WorkloadRun, Snapshot, Snapshot]]:
    """Warm up, then one measured window per concurrency: (client run, counters before, after).

    ``on_result(label, concurrency, requests done, requests in the window)`` after each request."""
    v = cfg.verify
    requests = sum(len(c.turns) for c in convs)
    warmup(server.base_url, server.model, v.warmup_requests, server.api_key, v.timeout_s)
    windows = []
    for c in v.concurrency:
        before = snapshot(server.base_url, server.api_key)
        done = [0]

        def tick(_r: Any, c: int = c, done: list[int] = done) -> None:
            done[0] += 1
            if on_result is not None:
                on_result(label, c, done[0], requests)

        run = run_workload(
            server.base_url,
            server.model,
            convs,
            concurrency=c,
            max_tokens=v.max_tokens,
            temperature=v.temperature,
            seed=v.seed,
            api_key=server.api_key,
            timeout_s=v.timeout_s,
            on_result=tick,
        )
        after = snapshot(server.base_url, server.api_key)
        windows.append((run, before, after))
    return windows


def save_outputs(path: Path, run: WorkloadRun) -> None:
    """Every turn's token ids and text (for the mismatch details and the offline estimate)."""
    write_text_atomic(path, "".join(json.dumps(r.to_dict()) + "\n" for r in run.results))


def _window_stats(run: WorkloadRun, before: Snapshot, after: Snapshot) -> dict[str, Any]:
    delta = after - before
    return {
        **run.client_stats(),
        **delta.summary(),
        "counters": {"before": before.raw(), "after": after.raw()},
    }


def _sim_vs_counters(sim: dict[str, Any], delta: Snapshot) -> dict[str, Any]:
    """The simulation on the n-gram server's own outputs next to that server's counters."""
    al = 1 + delta.accepted / delta.drafts if delta.drafts else None
    sal = sim["acceptance_length_proposing"]
    return {
        "drafts": {"simulated": sim["proposing_chains"], "vllm": delta.drafts},
        "draft_tokens": {"simulated": sim["proposed_tokens"], "vllm": delta.draft_tokens},
        # vLLM also counts tokens it accepted past max_tokens / a stop token before cutting the output
        "accepted": {
            "simulated": sim["accepted_tokens"],
            "vllm": delta.accepted,
            "unchecked_at_ends": sim["unchecked_tokens"],
        },
        "acceptance_length_proposing": {
            "simulated": sal,
            "vllm": al,
            "difference": sal - al if sal is not None and al is not None else None,
        },
    }


def ngram_section(
    cfg: Any,
    windows: list[dict[str, Any]],
    base: list,
    ngramw: list | None,
    info: dict[str, Any] | None,
    reason: str | None,
) -> dict[str, Any]:
    """The n-gram baseline's part of the report: vLLM's counters (over the steps where n-gram
    proposed something: vLLM counts no draft when nothing matched), the same simulated over the
    server's own outputs (which also gives the acceptance length over every step, the draft's
    definition), speedup per concurrency against the same baseline windows, greedy outputs."""
    v = cfg.verify
    spec = ngram_speculative_config(cfg)
    if ngramw is None:
        return {"measured": False, "reason": reason, "speculative_config": spec}
    k, lo, hi = v.num_speculative_tokens, v.ngram_prompt_lookup_min, v.ngram_prompt_lookup_max
    greedy = v.temperature == 0
    total = Snapshot()
    out_windows = []
    seqs_all: list[tuple[list[int], list[int]]] = []
    for w, (brun, _, _), (nrun, n0, n1) in zip(windows, base, ngramw):
        ns = _window_stats(nrun, n0, n1)
        total = total + (n1 - n0)
        seqs = [(r.prompt_token_ids, r.token_ids) for r in nrun.results]
        seqs_all += seqs
        sim = simulate_ngram(seqs, k, lo, hi)
        bt, nt = w["baseline"]["output_tokens_per_s"], ns["output_tokens_per_s"]
        btp, ntp = w["baseline"]["server_mean_tpot_s"], ns["server_mean_tpot_s"]
        out_windows.append(
            {
                "concurrency": nrun.concurrency,
                "ngram": ns,
                "speedup": nt / bt if bt and nt else None,
                "tpot_ratio": btp / ntp if btp and ntp else None,
                "acceptance_length_all_steps": sim["acceptance_length"],
                "simulated_vs_vllm": _sim_vs_counters(sim, n1 - n0),
                "outputs": compare_outputs(brun, nrun) if greedy else None,
            }
        )
    acceptance = total.summary()
    sim = simulate_ngram(seqs_all, k, lo, hi)
    compared = sum(w["outputs"]["compared"] for w in out_windows) if greedy else 0
    mism = sum(w["outputs"]["mismatches"] for w in out_windows) if greedy else 0
    return {
        "measured": True,
        "speculative_config": spec,
        **acceptance,  # acceptance_length etc.: vLLM's /metrics, proposing steps only
        "counters": total.raw(),
        "acceptance_length_all_steps": sim["acceptance_length"],
        "acceptance_per_position_all_steps": sim["acceptance_per_position"],
        "proposing_fraction": sim["proposing_chains"] / sim["chains"] if sim["chains"] else None,
        "speedup": {str(w["concurrency"]): w["speedup"] for w in out_windows},
        "windows": out_windows,
        "outputs": {
            "compared": compared,
            "mismatches": mism,
            "mismatch_fraction": mism / compared if compared else None,
            "greedy": greedy,
        },
        "simulated": {**sim, "vs_vllm": _sim_vs_counters(sim, total)},
        "server": info,
    }


def versus_ngram(
    acceptance_length: float | None, windows: list[dict[str, Any]], ngram: dict[str, Any]
) -> dict[str, Any] | None:
    """Draft vs n-gram baseline at the lowest concurrency (None when the baseline was not measured).

    The n-gram acceptance length compared is vLLM's own (over the steps where it proposed): the
    stricter of its two figures, as an EAGLE draft proposes at every step."""
    if not ngram.get("measured"):
        return None
    c = min(w["concurrency"] for w in windows)
    nal = ngram["acceptance_length"]
    return {
        "concurrency": c,
        "draft": {
            "acceptance_length": acceptance_length,
            "speedup": next(w["speedup"] for w in windows if w["concurrency"] == c),
        },
        # no drafts counted: n-gram never matched, every step emitted one token
        "ngram": {
            "acceptance_length": nal if nal is not None else 1.0,
            "acceptance_length_all_steps": ngram["acceptance_length_all_steps"],
            "speedup": ngram["speedup"].get(str(c)),
        },
    }


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
        f"verify: {len(convs)} conversations x {v.turns} turns, concurrency {v.concurrency}, k={v.num_speculative_tokens}"
        + (", then the n-gram baseline" if v.ngram_baseline else "")
    )

    with start_server(cfg, model, log_dir=out_dir / "logs") as base_server:
        log(f"verify: baseline ready in {base_server.ready_s:.1f} s")
        base = measure(base_server, convs, cfg, "baseline", on_progress)
        base_info = base_server.info()
    release_gpus(
        cfg, "verify (speculative server)", log=log
    )  # the baseline unit may still hold them
    with _speculative_server(cfg, model, spec, out_dir / "logs") as spec_server:
        log(f"verify: speculative ready in {spec_server.ready_s:.1f} s")
        specw = measure(spec_server, convs, cfg, "speculative", on_progress)
        spec_info = spec_server.info()
    ngramw, ngram_info, ngram_reason = (
        None,
        None,
        None if v.ngram_baseline else "verify.ngram_baseline is off",
    )
    if v.ngram_baseline:
        release_gpus(cfg, "verify (n-gram server)", log=log)
        # its own log folder: the draft server's log stays the only *.log with --speculative-config in logs/
        try:
            ngram_server = _ngram_server(
                cfg, model, ngram_speculative_config(cfg), out_dir / "logs" / "ngram"
            )
            if isinstance(ngram_server, str):
                ngram_reason = ngram_server
            else:
                with ngram_server:
                    log(f"verify: n-gram ready in {ngram_server.ready_s:.1f} s")
                    ngramw = measure(ngram_server, convs, cfg, "ngram", on_progress)
                    ngram_info = ngram_server.info()
        except Exception as e:  # noqa: BLE001 - a baseline that failed is reported; the draft's numbers stand
            ngramw, ngram_reason = None, f"the n-gram server failed: {type(e).__name__}: {e}"[:2000]
        if ngram_reason:
            log(f"verify: n-gram baseline not measured: {ngram_reason}")

    windows = []
    total = Snapshot()
    greedy = v.temperature == 0
    for (brun, b0, b1), (srun, s0, s1) in zip(base, specw):
        bs, ss = _window_stats(brun, b0, b1), _window_stats(srun, s0, s1)
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
    if greedy and len(base) > 1:
        # The same server at another concurrency: how much greedy output moves with batch shapes
        # alone (bf16 GEMMs of other shapes round differently). Spec-vs-baseline mismatches at
        # about this level are numerics, not speculation.
        ref = base[0][0]
        for w, (brun, _, _) in zip(windows[1:], base[1:]):
            w["baseline_vs_first_window"] = {
                k: v for k, v in compare_outputs(ref, brun).items() if k != "details"
            }
    for label, runs in (("baseline", base), ("speculative", specw), ("ngram", ngramw or [])):
        for run, _, _ in runs:
            save_outputs(out_dir / "outputs" / f"{label}-c{run.concurrency}.jsonl", run)
    acceptance = total.summary()
    compared = sum(w["outputs"]["compared"] for w in windows) if greedy else 0
    mism = sum(w["outputs"]["mismatches"] for w in windows) if greedy else 0
    outputs = {
        "compared": compared,
        "mismatches": mism,
        "mismatch_fraction": mism / compared if compared else None,
        "greedy": greedy,
    }

    offline = None
    if v.offline_estimate and greedy and Path(model).is_dir():
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
            f"verify: offline estimate {offline['acceptance_length']} vs vLLM {same} (all windows {al}); "
            f"n-gram simulated on the same sequences {(offline.get('ngram') or {}).get('acceptance_length')}"
        )

    ngram = ngram_section(cfg, windows, base, ngramw, ngram_info, ngram_reason)
    versus = versus_ngram(acceptance["acceptance_length"], windows, ngram)
    if ngram["measured"]:
        log(
            f"verify: n-gram baseline acceptance length {ngram['acceptance_length']} (vLLM, proposing steps), "
            f"{ngram['acceptance_length_all_steps']} over all steps; speedup {ngram['speedup']}"
        )

    conditions = {
        "workload_fingerprint": fp,
        "num_speculative_tokens": v.num_speculative_tokens,
        "temperature": v.temperature,
        "max_tokens": v.max_tokens,
    }
    prev = last_promoted(cfg.paths.runs_dir, cfg.name)
    gate = evaluate_gate(
        acceptance["acceptance_length"],
        conditions,
        prev,
        min_acceptance_length=v.min_acceptance_length,
        max_regression=v.max_regression,
        mismatch_fraction=outputs["mismatch_fraction"],
        max_mismatch_fraction=v.max_mismatch_fraction,
        require_beat_ngram=v.require_beat_ngram,
        versus_ngram=versus,
        ngram_reason=ngram.get("reason"),
    )
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
        "acceptance": {**acceptance, "counters": total.raw()},
        "acceptance_length": acceptance["acceptance_length"],
        "speedup": {str(w["concurrency"]): w["speedup"] for w in windows},
        "windows": windows,
        "outputs": outputs,
        "offline": offline,
        "ngram": ngram,
        "versus_ngram": versus,
        "gate": gate.to_dict(),
        "promoted": None,
        "servers": {"baseline": base_info, "speculative": spec_info, "ngram": ngram_info},
        "wall_s": None,
    }
    if gate.passed and v.promote:
        report["promoted"] = str(
            promote(
                draft_dir,
                cfg.paths.runs_dir,
                cfg.name,
                {
                    **conditions,
                    "acceptance_length": acceptance["acceptance_length"],
                    "report": str(out_dir / "report.json"),
                    "key": fp[:8],
                },
            )
        )
    report["wall_s"] = round(time.time() - started, 2)
    write_json_atomic(out_dir / "report.json", report)
    write_text_atomic(out_dir / "report.md", render_markdown(report))
    plot(report, out_dir / "report.png")
    if not gate.passed:
        raise GateFailed(
            f"verify gate failed for {draft_dir}: "
            + "; ".join(gate.reasons)
            + f" (report: {out_dir / 'report.md'}); the draft was not promoted"
        )
    return report
