"""The verify report as markdown and PNG (acceptance per position, throughput and speedup; the
n-gram baseline next to the draft when it was measured)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eagle3.atomic import atomic_path


def _f(x: Any, nd: int = 3) -> str:
    return "-" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))


def render_markdown(r: dict[str, Any]) -> str:
    lines = _summary_lines(r)
    lines += _acceptance_table(r)
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
        f"- **mean acceptance length {_f(acc['acceptance_length'])}**, "
        f"acceptance rate {_f(acc['acceptance_rate'])}",
        _ngram_line(r),
        f"- gate: **{'passed' if gate['passed'] else 'FAILED'}**"
        + ("" if gate["passed"] else ": " + "; ".join(gate["reasons"])),
        f"- promoted: `{r['promoted']}`" if r.get("promoted") else "- promoted: no",
    ]


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
            f"| {i} | {_f(v)} |"
            + (f" {_f(off[i]) if i < len(off) else '-'} |" if r.get("offline") else "")
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
            f"| {w['concurrency']} | {_f(b['output_tokens_per_s'], 1)} | "
            f"{_f(s['output_tokens_per_s'], 1)} | {_f(w['speedup'])} | "
            f"{_f(_ms(b['server_mean_tpot_s']), 2)} | {_f(_ms(s['server_mean_tpot_s']), 2)} | "
            f"{_f(w['tpot_ratio'])} | {_f(s['acceptance_length'])} | "
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
        f"- acceptance length {_f(o['acceptance_length'])} over {o['chains']} chains of "
        f"{o['sequences']} sequences; vLLM {_f(r['acceptance']['acceptance_length'])}; "
        f"difference {_f(o.get('difference_from_vllm'))}",
    ]
    on = o.get("ngram")
    if on:
        lines.append(
            f"- n-gram baseline simulated on the same sequences: acceptance length "
            f"{_f(on['acceptance_length'])} over all steps, "
            f"{_f(on['acceptance_length_proposing'])} over "
            f"the {on['proposing_chains']} of {on['chains']} steps where it proposed"
        )
    return lines


def _servers_lines(r: dict[str, Any]) -> list[str]:
    ng = (r["servers"].get("ngram") or {}).get("ready_s")
    return [
        "",
        f"Servers: baseline ready in {_f(r['servers']['baseline']['ready_s'], 1)} s, "
        f"speculative in {_f(r['servers']['speculative']['ready_s'], 1)} s"
        + (f", n-gram in {_f(ng, 1)} s." if ng is not None else "."),
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
        f"{sc['prompt_lookup_max']}): acceptance length {_f(ng['acceptance_length'])} "
        f"in vLLM (steps where it proposed), {_f(ng['acceptance_length_all_steps'])} over all "
        f"steps; speedup at concurrency {c}: "
        f"draft x{_f((vs.get('draft') or {}).get('speedup'))}, "
        f"n-gram x{_f((vs.get('ngram') or {}).get('speedup'))}; **draft beats n-gram: "
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
        f"{_f(_pct(ng.get('proposing_fraction')), 1)} % of the steps "
        "(simulated over its own outputs); over all steps is the draft's definition.",
        "",
        "| | draft (EAGLE-3) | n-gram (vLLM, proposing steps) | n-gram (all steps, simulated) |",
        "|---|---|---|---|",
        f"| acceptance length | {_f(acc['acceptance_length'])} | {_f(ng['acceptance_length'])} | "
        f"{_f(ng['acceptance_length_all_steps'])} |",
    ]
    dpp, npp = acc["acceptance_per_position"], ng.get("acceptance_per_position") or []
    sap = ng.get("acceptance_per_position_all_steps") or []
    for i in range(k):
        lines.append(
            f"| acceptance at position {i} | {_f(dpp[i]) if i < len(dpp) else '-'} | "
            f"{_f(npp[i]) if i < len(npp) else '-'} | {_f(sap[i]) if i < len(sap) else '-'} |"
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
            f"| {w['concurrency']} | {_f(w['baseline']['output_tokens_per_s'], 1)} | "
            f"{_f(w['speculative']['output_tokens_per_s'], 1)} | {_f(w['speedup'])} | "
            f"{_f(nw['ngram']['output_tokens_per_s'], 1)} | {_f(nw['speedup'])} | "
            f"{_f(nw['ngram']['acceptance_length'])} | "
            f"{mm.get('mismatches', '-')} / {mm.get('compared', '-')} |"
        )
    sv = (ng.get("simulated") or {}).get("vs_vllm") or {}
    if sv:
        lines += [
            "",
            "Simulated over the n-gram server's own outputs (`eagle3/verify/ngram.py`) "
            "vs its counters: "
            + ", ".join(
                f"{name} {_f(sv[name]['simulated'], 0)} vs {_f(sv[name]['vllm'], 0)}"
                for name in ("drafts", "draft_tokens", "accepted")
            )
            + f"; acceptance length {_f(sv['acceptance_length_proposing']['simulated'])} vs "
            f"{_f(sv['acceptance_length_proposing']['vllm'])}.",
        ]
    return lines


def _pct(x: float | None) -> float | None:
    return None if x is None else 100 * x


def plot(r: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    acc = r["acceptance"]["acceptance_per_position"]
    xs = list(range(len(acc)))
    off = (r.get("offline") or {}).get("acceptance_per_position") or []
    ng = r.get("ngram") if (r.get("ngram") or {}).get("measured") else None
    series = [("draft (vLLM)", acc)]
    if off:
        series.append(("draft (offline estimate)", off))
    if ng:
        series.append(("n-gram (vLLM, proposing steps)", ng.get("acceptance_per_position") or []))
        series.append(
            ("n-gram (all steps, simulated)", ng.get("acceptance_per_position_all_steps") or [])
        )
    w = 0.8 / len(series)
    for j, (label, vals) in enumerate(series):
        n = min(len(vals), len(xs))
        a1.bar([x - 0.4 + w * (j + 0.5) for x in xs[:n]], vals[:n], width=w, label=label)
    a1.set_xticks(xs)
    a1.set_xlabel("draft position")
    a1.set_ylabel("accepted / drafts")
    a1.set_ylim(0, 1)
    title = f"acceptance per position (mean length {_f(r['acceptance']['acceptance_length'])}"
    if ng:
        title += f"; n-gram {_f(ng['acceptance_length'])} / {_f(ng['acceptance_length_all_steps'])}"
    a1.set_title(title + ")", fontsize=9)
    a1.legend(fontsize=8)
    conc = [str(win["concurrency"]) for win in r["windows"]]
    bars = [
        ("baseline", [win["baseline"]["output_tokens_per_s"] or 0 for win in r["windows"]], None),
        (
            "draft",
            [win["speculative"]["output_tokens_per_s"] or 0 for win in r["windows"]],
            [win["speedup"] for win in r["windows"]],
        ),
    ]
    if ng:
        bars.append(
            (
                "n-gram",
                [nw["ngram"]["output_tokens_per_s"] or 0 for nw in ng["windows"]],
                [nw["speedup"] for nw in ng["windows"]],
            )
        )
    xs2 = list(range(len(conc)))
    w2 = 0.8 / len(bars)
    for j, (label, vals, speedups) in enumerate(bars):
        pos = [x - 0.4 + w2 * (j + 0.5) for x in xs2]
        a2.bar(pos, vals, width=w2, label=label)
        for x, v, sp in zip(pos, vals, speedups or []):
            a2.annotate(f"x{_f(sp, 2)}", (x, v), ha="center", va="bottom", fontsize=8)
    a2.set_xticks(xs2, conc)
    a2.set_xlabel("concurrency")
    a2.set_ylabel("output tokens/s")
    a2.set_title("throughput and speedup over the baseline")
    top = max((v for _, vals, _ in bars for v in vals), default=0)
    if top > 0:
        a2.set_ylim(0, top * 1.25)  # room for the speedup labels and the legend
    a2.legend(fontsize=8, ncol=len(bars), loc="upper center")
    fig.tight_layout()
    with atomic_path(path, suffix=".tmp.png") as tmp:
        fig.savefig(tmp, dpi=100)
    plt.close(fig)
    return path
