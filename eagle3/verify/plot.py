"""The verify report's PNG: acceptance per position, throughput and speedup, and after a k sweep
tokens/s by k (predicted and measured) and acceptance per workload category."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle3.atomic import atomic_path
from eagle3.verify.report import fmt


def plot(r: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = len((r.get("sweep") or {}).get("ks") or []) > 1
    groups = (r.get("offline") or {}).get("by_group") or {}
    extra = sweep or bool(groups)
    fig, axes = plt.subplots(2 if extra else 1, 2, figsize=(11, 8 if extra else 4), squeeze=False)
    _plot_positions(r, axes[0][0])
    _plot_throughput(r, axes[0][1])
    if extra:
        if sweep:
            _plot_sweep(r, axes[1][0])
        else:
            axes[1][0].axis("off")
        if groups:
            _plot_categories(r, groups, axes[1][1])
        else:
            axes[1][1].axis("off")
    fig.tight_layout()
    with atomic_path(path, suffix=".tmp.png") as tmp:
        fig.savefig(tmp, dpi=100)
    plt.close(fig)
    return path


def _ngram_measured(r: dict[str, Any]) -> dict[str, Any] | None:
    return r.get("ngram") if (r.get("ngram") or {}).get("measured") else None


def _plot_positions(r: dict[str, Any], a1: Any) -> None:
    acc = r["acceptance"]["acceptance_per_position"]
    xs = list(range(len(acc)))
    off = (r.get("offline") or {}).get("acceptance_per_position") or []
    ng = _ngram_measured(r)
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
    title = f"acceptance per position, k={r['num_speculative_tokens']} (mean length "
    title += fmt(r["acceptance"]["acceptance_length"])
    if ng:
        al, al_all = ng["acceptance_length"], ng["acceptance_length_all_steps"]
        title += f"; n-gram {fmt(al)} / {fmt(al_all)}"
    a1.set_title(title + ")", fontsize=9)
    a1.legend(fontsize=8)


def _plot_throughput(r: dict[str, Any], a2: Any) -> None:
    ng = _ngram_measured(r)
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
            a2.annotate(f"x{fmt(sp, 2)}", (x, v), ha="center", va="bottom", fontsize=8)
    a2.set_xticks(xs2, conc)
    a2.set_xlabel("concurrency")
    a2.set_ylabel("output tokens/s")
    a2.set_title("throughput and speedup over the baseline (each method at its k)", fontsize=9)
    top = max((v for _, vals, _ in bars for v in vals), default=0)
    if top > 0:
        a2.set_ylim(0, top * 1.25)  # room for the speedup labels and the legend
    a2.legend(fontsize=8, ncol=len(bars), loc="upper center")


def _plot_sweep(r: dict[str, Any], ax: Any) -> None:
    """Tokens/s against k: predicted (lines), measured (markers), per method and concurrency,
    each relative to the target alone at that concurrency."""
    sw = r["sweep"]
    base = sw.get("baseline_tokens_per_s") or {}
    for name, style in (("draft", "-"), ("ngram", "--")):
        m = sw.get(name)
        if not m:
            continue
        for c, pred in m["predicted_tokens_per_s"].items():
            b = base.get(c) or 1.0
            ks = [int(k) for k in pred]
            (line,) = ax.plot(ks, [v / b for v in pred.values()], style, label=f"{name} c={c}")
            meas = [(int(k), s[c] / b) for k, s in m["measured_tokens_per_s"].items() if c in s]
            ax.plot(
                [k for k, _ in meas],
                [v for _, v in meas],
                "o",
                color=line.get_color(),
            )
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks([int(k) for k in sw.get("ks") or []] or ax.get_xticks())
    ax.set_xlabel("num_speculative_tokens (k)")
    ax.set_ylabel("tokens/s over the target alone")
    ax.set_title("which k: speedup by k (lines predicted, dots measured)", fontsize=9)
    ax.legend(fontsize=7, ncol=2, loc="best")  # one entry a line: eight hid the dots


def _plot_categories(r: dict[str, Any], groups: dict[str, Any], ax: Any) -> None:
    names = list(groups)
    xs = list(range(len(names)))
    d = [groups[g]["acceptance_length"] or 0 for g in names]
    n = [(groups[g].get("ngram") or {}).get("acceptance_length") or 0 for g in names]
    ax.bar([x - 0.2 for x in xs], d, width=0.4, label="draft (offline estimate)")
    ax.bar([x + 0.2 for x in xs], n, width=0.4, label="n-gram (simulated, all steps)")
    ax.set_xticks(xs, names, rotation=30, fontsize=8)
    ax.set_ylabel("acceptance length")
    ax.set_title(f"acceptance per category, k={r['num_speculative_tokens']}", fontsize=9)
    ax.legend(fontsize=8)
