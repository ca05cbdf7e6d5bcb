"""The verify report as markdown (acceptance per position, throughput and speedup, the k sweep,
per category; the n-gram baseline next to the draft when it was measured). The PNG: plot.py."""

from __future__ import annotations

import json
from typing import Any


def fmt(x: Any, nd: int = 3) -> str:
    return "-" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))


def render_markdown(r: dict[str, Any]) -> str:
    lines = _summary_lines(r)
    lines += _serving_lines(r)
    lines += _sweep_lines(r)
    lines += _acceptance_table(r)
    lines += _category_lines(r)
    lines += _throughput_table(r)
    lines += _baseline_drift_lines(r)
    lines += _ngram_markdown(r)
    lines += _offline_lines(r)
    lines += _servers_lines(r)
    return "\n".join(lines)


def _summary_lines(r: dict[str, Any]) -> list[str]:
    acc = r["acceptance"]
    gate = r["gate"]
    wl = r["workload"]
    return [
        f"# Verify: {r['profile']}",
        "",
        f"- draft: `{r['draft_dir']}` (k = {r['num_speculative_tokens']}, "
        f"temperature {r['temperature']})",
        f"- workload: {wl['name']}, {wl['conversations']} conversations x "
        f"{wl['turns']} turns, max_tokens {r['max_tokens']} (fingerprint {wl['fingerprint']})",
        f"- **mean acceptance length {fmt(acc['acceptance_length'])}**, "
        f"acceptance rate {fmt(acc['acceptance_rate'])}",
        _ngram_line(r),
        f"- gate: **{'passed' if gate['passed'] else 'FAILED'}**"
        + ("" if gate["passed"] else ": " + "; ".join(gate["reasons"])),
        f"- promoted: `{r['promoted']}`" if r.get("promoted") else "- promoted: no",
    ]


def _serving_lines(r: dict[str, Any]) -> list[str]:
    """Which k to serve, per concurrency: the draft at its best measured k vs n-gram at its."""
    serving = r.get("serving") or {}
    if not serving:
        return []
    lines = ["", "## What to serve", ""]
    for c, e in serving.items():
        ng = e.get("ngram")
        how = "parallel drafting, " if e.get("method") == "parallel" else ""
        other = e.get("other_method")
        lines.append(
            f"- concurrency {c}: **{how}k = {e['num_speculative_tokens']}**, "
            f"{fmt(e['tokens_per_s'], 1)} tok/s (x{fmt(e['speedup'], 2)} over the target alone)"
            + (
                f"; n-gram at its best k = {ng['num_speculative_tokens']}: "
                f"{fmt(ng['tokens_per_s'], 1)} tok/s (x{fmt(ng['speedup'], 2)}); draft / n-gram "
                f"x{fmt(e.get('draft_over_ngram'), 2)}"
                if ng
                else ""
            )
            + (
                f"; {other['method']} drafting at its best k = {other['num_speculative_tokens']}: "
                f"{fmt(other['tokens_per_s'], 1)} tok/s"
                if other
                else ""
            )
            + f"; `--speculative-config '{json.dumps(e['speculative_config'])}'`"
        )
    for name in ("draft", "parallel", "ngram"):
        m = (r.get("sweep") or {}).get(name) or {}
        for c, k in (m.get("best_predicted") or {}).items():
            if k not in m["served"]:
                lines.append(
                    f"- {name} at concurrency {c}: k = {k} was predicted best "
                    f"({fmt(m['predicted_tokens_per_s'][c][str(k)], 1)} tok/s) but not served: "
                    "raise verify.sweep_servers to measure it"
                )
    if r.get("promoted"):
        lines.append(f"- the promoted draft carries this as `{r['promoted']}/serving.json`")
    return lines


def _sweep_lines(r: dict[str, Any]) -> list[str]:
    """The k sweep: acceptance length and tokens/s for every k, predicted and measured."""
    sw = r.get("sweep") or {}
    if len(sw.get("ks") or []) < 2:
        return []
    lines = [
        "",
        "## Tokens/s for every k (predicted from the offline acceptance and the served ks' step "
        "time; measured where served)",
    ]
    titles = {
        "draft": "draft (EAGLE-3)",
        "parallel": "draft with parallel drafting (one draft pass for all k tokens)",
        "ngram": "n-gram (prompt lookup)",
    }
    for name in ("draft", "parallel", "ngram"):
        m = sw.get(name)
        if not m:
            continue
        cs = list(m["predicted_tokens_per_s"])
        lines += [
            "",
            f"**{titles[name]}**, served at "
            f"k = {m['served']}; best measured {m['best_measured']}, best predicted "
            f"{m['best_predicted']}",
            "",
            "| k | acceptance length | "
            + " | ".join(f"c={c} predicted | c={c} measured" for c in cs)
            + " |",
            "|---|---|" + "---|---|" * len(cs),
        ]
        for k in m["ks"]:
            row = f"| {k} | {fmt(m['acceptance_length'].get(str(k)))} |"
            for c in cs:
                meas = (m["measured_tokens_per_s"].get(str(k)) or {}).get(c)
                row += f" {fmt(m['predicted_tokens_per_s'][c].get(str(k)), 1)} | {fmt(meas, 1)} |"
            lines.append(row)
        for ch in m.get("checks") or []:
            lines.append(
                f"- k={ch['k']} at c={ch['concurrency']}: predicted {fmt(ch['predicted'], 1)} from "
                f"k={ch['from_ks']}, measured {fmt(ch['measured'], 1)} tok/s "
                f"(error {fmt(_pct(ch['error']), 1)} %)"
            )
    return lines


def _category_lines(r: dict[str, Any]) -> list[str]:
    """Where the draft is weak: the offline estimate per workload category, n-gram beside it."""
    groups = (r.get("offline") or {}).get("by_group") or {}
    if not groups:
        return []
    lines = [
        "",
        f"## Acceptance per category (offline estimate, k = {r['num_speculative_tokens']}; "
        "n-gram simulated on the same sequences, over all steps)",
        "",
        "| category | sequences | chains | draft | draft per position | n-gram "
        "| n-gram per position |",
        "|---|---|---|---|---|---|---|",
    ]
    for g, o in groups.items():
        ng = o.get("ngram") or {}
        lines.append(
            f"| {g} | {o['sequences']} | {o['chains']} | {fmt(o['acceptance_length'])} | "
            f"{' / '.join(fmt(x, 2) for x in o['acceptance_per_position'])} | "
            f"{fmt(ng.get('acceptance_length'))} | "
            f"{' / '.join(fmt(x, 2) for x in ng.get('acceptance_per_position') or [])} |"
        )
    return lines


def _acceptance_table(r: dict[str, Any]) -> list[str]:
    lines = [
        "",
        "## Acceptance per position (vLLM counters)",
        "",
        "| position | accepted / drafts |" + (" offline estimate |" if r.get("offline") else ""),
        "|---|---|" + ("---|" if r.get("offline") else ""),
    ]
    off = (r.get("offline") or {}).get("acceptance_per_position") or []
    for i, v in enumerate(r["acceptance"]["acceptance_per_position"]):
        lines.append(
            f"| {i} | {fmt(v)} |"
            + (f" {fmt(off[i]) if i < len(off) else '-'} |" if r.get("offline") else "")
        )
    return lines


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1000


def _throughput_table(r: dict[str, Any]) -> list[str]:
    lines = [
        "",
        "## Throughput",
        "",
        "| concurrency | baseline tok/s | speculative tok/s | speedup | baseline TPOT ms "
        "| speculative TPOT ms | TPOT ratio | acceptance length | greedy mismatches |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for w in r["windows"]:
        b, s = w["baseline"], w["speculative"]
        mm = w.get("outputs") or {}
        lines.append(
            f"| {w['concurrency']} | {fmt(b['output_tokens_per_s'], 1)} | "
            f"{fmt(s['output_tokens_per_s'], 1)} | {fmt(w['speedup'])} | "
            f"{fmt(_ms(b['server_mean_tpot_s']), 2)} | {fmt(_ms(s['server_mean_tpot_s']), 2)} | "
            f"{fmt(w['tpot_ratio'])} | {fmt(s['acceptance_length'])} | "
            f"{mm.get('mismatches', '-')} / {mm.get('compared', '-')} |"
        )
    return lines


def _baseline_drift_lines(r: dict[str, Any]) -> list[str]:
    """How much the baseline's own greedy outputs moved between concurrencies."""
    moved = [
        (w["concurrency"], w["baseline_vs_first_window"])
        for w in r["windows"]
        if w.get("baseline_vs_first_window")
    ]
    if not moved:
        return []
    first = r["windows"][0]["concurrency"]
    return [
        "",
        "Greedy outputs of the baseline itself at another concurrency (batch-shape numerics "
        "alone): "
        + ", ".join(
            f"c={c}: {m['mismatches']} / {m['compared']} differ from c={first}" for c, m in moved
        )
        + ".",
    ]


def _offline_lines(r: dict[str, Any]) -> list[str]:
    if not r.get("offline"):
        return []
    o = r["offline"]
    lines = [
        "",
        "## Offline estimate (PyTorch, target + draft, greedy chains)",
        "",
        f"- acceptance length {fmt(o['acceptance_length'])} over {o['chains']} chains of "
        f"{o['sequences']} sequences; vLLM {fmt(r['acceptance']['acceptance_length'])}; "
        f"difference {fmt(o.get('difference_from_vllm'))}",
    ]
    on = o.get("ngram")
    if on:
        lines.append(
            f"- n-gram baseline simulated on the same sequences: acceptance length "
            f"{fmt(on['acceptance_length'])} over all steps, "
            f"{fmt(on['acceptance_length_proposing'])} over "
            f"the {on['proposing_chains']} of {on['chains']} steps where it proposed"
        )
    return lines


def _servers_lines(r: dict[str, Any]) -> list[str]:
    ng = (r["servers"].get("ngram") or {}).get("ready_s")
    return [
        "",
        f"Servers: baseline ready in {fmt(r['servers']['baseline']['ready_s'], 1)} s, "
        f"speculative in {fmt(r['servers']['speculative']['ready_s'], 1)} s"
        + (f", n-gram in {fmt(ng, 1)} s." if ng is not None else "."),
        "",
    ]


def _ngram_line(r: dict[str, Any]) -> str:
    """One summary line: the draft against the free baseline."""
    ng = r.get("ngram")
    if not ng:
        return "- n-gram baseline: not run"
    if not ng.get("measured"):
        return f"- n-gram baseline: not measured ({ng.get('reason')})"
    vs = r.get("versus_ngram") or {}
    c = vs.get("concurrency")
    beats = (r.get("gate") or {}).get("checks", {}).get("beats_ngram")
    sc = ng["speculative_config"]
    return (
        f"- n-gram baseline (prompt lookup, n {sc['prompt_lookup_min']}.."
        f"{sc['prompt_lookup_max']}): acceptance length {fmt(ng['acceptance_length'])} "
        f"in vLLM (steps where it proposed), {fmt(ng['acceptance_length_all_steps'])} over all "
        f"steps; speedup at concurrency {c}: "
        f"draft x{fmt((vs.get('draft') or {}).get('speedup'))}, "
        f"n-gram x{fmt((vs.get('ngram') or {}).get('speedup'))}; **draft beats n-gram: "
        f"{'yes' if beats else 'no' if beats is not None else '-'}**"
    )


def _ngram_markdown(r: dict[str, Any]) -> list[str]:
    ng = r.get("ngram")
    if not ng or not ng.get("measured"):
        return []
    acc = r["acceptance"]
    k = r["num_speculative_tokens"]
    lines = [
        "",
        "## N-gram baseline (prompt lookup) vs the draft",
        "",
        "Same workload on the target served with "
        f"`--speculative-config '{json.dumps(ng['speculative_config'])}'`. "
        "vLLM counts only the steps where n-gram proposed something (no match, no draft); "
        "an EAGLE draft proposes at every step. N-gram proposed at "
        f"{fmt(_pct(ng.get('proposing_fraction')), 1)} % of the steps "
        "(simulated over its own outputs); over all steps is the draft's definition.",
        "",
        "| | draft (EAGLE-3) | n-gram (vLLM, proposing steps) | n-gram (all steps, simulated) |",
        "|---|---|---|---|",
        f"| acceptance length | {fmt(acc['acceptance_length'])} | {fmt(ng['acceptance_length'])} | "
        f"{fmt(ng['acceptance_length_all_steps'])} |",
    ]
    dpp, npp = acc["acceptance_per_position"], ng.get("acceptance_per_position") or []
    sap = ng.get("acceptance_per_position_all_steps") or []
    for i in range(k):
        lines.append(
            f"| acceptance at position {i} | {fmt(dpp[i]) if i < len(dpp) else '-'} | "
            f"{fmt(npp[i]) if i < len(npp) else '-'} | {fmt(sap[i]) if i < len(sap) else '-'} |"
        )
    lines += [
        "",
        "| concurrency | baseline tok/s | draft tok/s | draft speedup | n-gram tok/s "
        "| n-gram speedup | n-gram acceptance length | n-gram greedy mismatches |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for w, nw in zip(r["windows"], ng["windows"]):
        mm = nw.get("outputs") or {}
        lines.append(
            f"| {w['concurrency']} | {fmt(w['baseline']['output_tokens_per_s'], 1)} | "
            f"{fmt(w['speculative']['output_tokens_per_s'], 1)} | {fmt(w['speedup'])} | "
            f"{fmt(nw['ngram']['output_tokens_per_s'], 1)} | {fmt(nw['speedup'])} | "
            f"{fmt(nw['ngram']['acceptance_length'])} | "
            f"{mm.get('mismatches', '-')} / {mm.get('compared', '-')} |"
        )
    sv = (ng.get("simulated") or {}).get("vs_vllm") or {}
    if sv:
        lines += [
            "",
            "Simulated over the n-gram server's own outputs (`eagle3/verify/ngram.py`) "
            "vs its counters: "
            + ", ".join(
                f"{name} {fmt(sv[name]['simulated'], 0)} vs {fmt(sv[name]['vllm'], 0)}"
                for name in ("drafts", "draft_tokens", "accepted")
            )
            + f"; acceptance length {fmt(sv['acceptance_length_proposing']['simulated'])} vs "
            f"{fmt(sv['acceptance_length_proposing']['vllm'])}.",
        ]
    return lines


def _pct(x: float | None) -> float | None:
    return None if x is None else 100 * x
