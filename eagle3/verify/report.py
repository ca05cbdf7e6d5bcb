"""The verify report as markdown and PNG (acceptance per position, throughput and speedup)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _f(x: Any, nd: int = 3) -> str:
    return "-" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))


def render_markdown(r: dict[str, Any]) -> str:
    acc = r["acceptance"]
    gate = r["gate"]
    lines = [
        f"# Verify: {r['profile']}",
        "",
        f"- draft: `{r['draft_dir']}` (k = {r['num_speculative_tokens']}, temperature {r['temperature']})",
        f"- workload: {r['workload']['name']}, {r['workload']['conversations']} conversations x "
        f"{r['workload']['turns']} turns, max_tokens {r['max_tokens']} (fingerprint {r['workload']['fingerprint']})",
        f"- **mean acceptance length {_f(acc['acceptance_length'])}**, acceptance rate {_f(acc['acceptance_rate'])}",
        f"- gate: **{'passed' if gate['passed'] else 'FAILED'}**" + ("" if gate["passed"] else
                                                                    ": " + "; ".join(gate["reasons"])),
        f"- promoted: `{r['promoted']}`" if r.get("promoted") else "- promoted: no",
        "",
        "## Acceptance per position (vLLM counters)",
        "",
        "| position | accepted / drafts |" + (" offline estimate |" if r.get("offline") else ""),
        "|---|---|" + ("---|" if r.get("offline") else ""),
    ]
    off = (r.get("offline") or {}).get("acceptance_per_position") or []
    for i, v in enumerate(acc["acceptance_per_position"]):
        lines.append(f"| {i} | {_f(v)} |" + (f" {_f(off[i]) if i < len(off) else '-'} |" if r.get("offline") else ""))
    lines += ["", "## Throughput", "",
              "| concurrency | baseline tok/s | speculative tok/s | speedup | baseline TPOT ms | speculative TPOT ms "
              "| TPOT ratio | acceptance length | greedy mismatches |",
              "|---|---|---|---|---|---|---|---|---|"]
    for w in r["windows"]:
        b, s = w["baseline"], w["speculative"]
        ms = lambda x: None if x is None else x * 1000  # noqa: E731
        mm = w.get("outputs") or {}
        lines.append(
            f"| {w['concurrency']} | {_f(b['output_tokens_per_s'], 1)} | {_f(s['output_tokens_per_s'], 1)} | "
            f"{_f(w['speedup'])} | {_f(ms(b['server_mean_tpot_s']), 2)} | {_f(ms(s['server_mean_tpot_s']), 2)} | "
            f"{_f(w['tpot_ratio'])} | {_f(s['acceptance_length'])} | "
            f"{mm.get('mismatches', '-')} / {mm.get('compared', '-')} |")
    moved = [(w["concurrency"], w["baseline_vs_first_window"]) for w in r["windows"] if w.get("baseline_vs_first_window")]
    if moved:
        lines += ["", "Greedy outputs of the baseline itself at another concurrency (batch-shape numerics alone): "
                  + ", ".join(f"c={c}: {m['mismatches']} / {m['compared']} differ from c={r['windows'][0]['concurrency']}"
                              for c, m in moved) + "."]
    if r.get("offline"):
        o = r["offline"]
        lines += ["", "## Offline estimate (PyTorch, target + draft, greedy chains)", "",
                  f"- acceptance length {_f(o['acceptance_length'])} over {o['chains']} chains of {o['sequences']} "
                  f"sequences; vLLM {_f(acc['acceptance_length'])}; difference {_f(o.get('difference_from_vllm'))}"]
    lines += ["", f"Servers: baseline ready in {_f(r['servers']['baseline']['ready_s'], 1)} s, speculative in "
              f"{_f(r['servers']['speculative']['ready_s'], 1)} s.", ""]
    return "\n".join(lines)


def plot(r: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    acc = r["acceptance"]["acceptance_per_position"]
    xs = list(range(len(acc)))
    off = (r.get("offline") or {}).get("acceptance_per_position") or []
    w = 0.4 if off else 0.8
    a1.bar([x - (w / 2 if off else 0) for x in xs], acc, width=w, label="vLLM")
    if off:
        a1.bar([x + w / 2 for x in xs[: len(off)]], off[: len(xs)], width=w, label="offline estimate")
    a1.set_xticks(xs)
    a1.set_xlabel("draft position")
    a1.set_ylabel("accepted / drafts")
    a1.set_ylim(0, 1)
    a1.set_title(f"acceptance per position (mean length {_f(r['acceptance']['acceptance_length'])})")
    a1.legend()
    conc = [str(win["concurrency"]) for win in r["windows"]]
    base = [win["baseline"]["output_tokens_per_s"] or 0 for win in r["windows"]]
    spec = [win["speculative"]["output_tokens_per_s"] or 0 for win in r["windows"]]
    xs2 = list(range(len(conc)))
    a2.bar([x - 0.2 for x in xs2], base, width=0.4, label="baseline")
    a2.bar([x + 0.2 for x in xs2], spec, width=0.4, label="speculative")
    for x, win in zip(xs2, r["windows"]):
        a2.annotate(f"x{_f(win['speedup'], 2)}", (x, max(base[x], spec[x])), ha="center", va="bottom")
    a2.set_xticks(xs2, conc)
    a2.set_xlabel("concurrency")
    a2.set_ylabel("output tokens/s")
    a2.set_title("throughput and speedup")
    a2.legend()
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(path)
    return path
