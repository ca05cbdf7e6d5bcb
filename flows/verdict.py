"""The hero run's closing verdict: what to serve on this machine, why the draft loses when it
does, what to run for one that wins; and the gate's word for what it actually checked.

`make demo` used to end with "gate passed, promoted" above a line where the promoted draft served
slower than the free n-gram baseline (issue 41): the gate checks acceptance (a minimum, no
regression, greedy outputs) and checks n-gram only with ``verify.require_beat_ngram``. These
functions read the verify report (its ``serving`` and ``gate``) and the train manifest; they run
nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from eagle3.verify.report import fmt

# The draft that wins on this target (docs/benchmarks.md, "At offline speed", the full mixture, and
# "Which k", the smollm2-sharegpt draft; measured 2026-12-06/07).
WINNING_PROFILE = "configs/smollm2-sharegpt.yaml"
WINNING_FIGURES = (
    "MT-bench acceptance length 2.724-2.727 against n-gram's 1.942 (k=3; 20,877 samples of "
    "~10,000 ShareGPT conversations, 6 epochs, 12,512 steps on one H100: docs/benchmarks.md); "
    "served on 2 CPU cores it measured x1.32 against n-gram's x1.27 at concurrency 1 (64 tokens "
    "a turn): on a CPU the draft's own forward costs what prompt lookup does not"
)


@dataclass
class Choice:
    """The fastest way to serve at one concurrency, and the draft's figure beside it."""

    concurrency: str
    method: str  # "draft", "draft (parallel drafting)", "n-gram" or "the target alone"
    k: int | None
    tokens_per_s: float
    speedup: float | None
    draft: dict[str, Any]  # the report's serving entry (the draft at its best measured k)

    @property
    def draft_wins(self) -> bool:
        return self.method.startswith("draft")

    def text(self) -> str:
        what = self.method + (f" k={self.k}" if self.k is not None else "")
        head = f"c={self.concurrency}: {what} ({fmt(self.tokens_per_s, 1)} tok/s"
        if self.speedup is not None and self.method != "the target alone":
            head += f", x{fmt(self.speedup, 2)} the target alone"
        if self.draft_wins:
            return head + ")"
        d = self.draft
        return head + (
            f"; the {draft_method(d)} k={d['num_speculative_tokens']}: "
            f"{fmt(d['tokens_per_s'], 1)} tok/s)"
        )


def draft_method(entry: dict[str, Any]) -> str:
    """The draft's way of drafting in a serving entry (parallel drafting: one draft pass
    proposes all k tokens)."""
    return "draft (parallel drafting)" if entry.get("method") == "parallel" else "draft"


def choices(serving: dict[str, Any]) -> list[Choice]:
    """Per concurrency, the fastest measured of the draft, n-gram and the target alone (the
    verify report's ``serving``: each method at its best measured k)."""
    out = []
    for c, e in serving.items():
        tps, speedup = e.get("tokens_per_s"), e.get("speedup")
        cands = [(draft_method(e), e["num_speculative_tokens"], tps, speedup)]
        ng = e.get("ngram")
        if ng and ng.get("tokens_per_s") is not None:
            cands.append(
                ("n-gram", ng["num_speculative_tokens"], ng["tokens_per_s"], ng["speedup"])
            )
        if speedup and tps:  # the target alone: the speedups' denominator
            cands.append(("the target alone", None, tps / speedup, 1.0))
        cands = [x for x in cands if x[2] is not None]
        if not cands:  # nothing measured at this concurrency
            continue
        method, k, best, sp = max(cands, key=lambda x: x[2])
        out.append(Choice(c, method, k, best, sp, e))
    return out


def _n(count: Any, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def gate_words(gate: dict[str, Any], promoted: str | None, acceptance_length: float | None) -> str:
    """What the gate checked, in the words of what it checked: a gate that did not require
    beating n-gram says so (and whether the draft did)."""
    if not gate:
        return "gate: not run"
    if not gate.get("passed"):
        return "gate FAILED (" + "; ".join(gate.get("reasons") or []) + "): not promoted"
    checks = gate.get("checks") or {}
    said = [f"acceptance length {fmt(acceptance_length)} >= {checks.get('min_acceptance_length')}"]
    prev = checks.get("previous")
    if isinstance(prev, dict):
        said.append(f"not below the last promoted draft's {fmt(prev.get('acceptance_length'))}")
    if checks.get("max_mismatch_fraction") is not None:
        said.append("greedy outputs as the target's")
    text = "gate: passed its acceptance checks (" + "; ".join(said) + ")"
    if checks.get("require_beat_ngram"):
        text += " and beats the n-gram baseline"
    elif checks.get("beats_ngram") is False:
        text += (
            "; beating n-gram was not required (verify.require_beat_ngram: false) and it does not"
        )
    return text + (f"; promoted to {promoted}" if promoted else "; not promoted")


def verdict_lines(report: dict[str, Any], train: dict[str, Any]) -> list[str]:
    """The run's last lines: what to serve here; when the draft is not it, why (its training
    size, from the train manifest) and what to run for a draft that wins."""
    picks = choices(report.get("serving") or {})
    if not picks:
        return []
    lines = ["serve on this machine: " + "; ".join(p.text() for p in picks)]
    if all(p.draft_wins for p in picks):
        return lines
    ng = (report.get("ngram") or {}).get("acceptance_length_all_steps")
    versus = f" against n-gram's {fmt(ng)} over all steps" if ng is not None else ""
    lines.append(
        f"why the draft loses: it trained on {_n(train.get('samples'), 'sample')} in "
        f"{_n(train.get('steps'), 'step')} ({_n(train.get('epochs'), 'epoch')}), the demo's size "
        f"(enough to run every stage): its acceptance length "
        f"{fmt(report.get('acceptance_length'))}{versus} does not pay for its own forward here"
    )
    lines.append(
        f"for a draft that wins: python -m flows.hero_run -c {WINNING_PROFILE} "
        "(extract and train on a GPU)"
    )
    lines.append(f"  its measured figures: {WINNING_FIGURES}")
    return lines
