"""Which k to serve: tokens/s of the draft and of the n-gram baseline at every k, from few servers.

Serving every k of a sweep costs a server start and a workload per k and method (11 servers for
k = 1..5 with the baseline). Two things decide tokens/s at k, and both are cheaper to get:

- **tokens per step** (the acceptance length AL(k)) for EVERY k from one pass: the offline
  estimate's chains at the largest k, capped at each smaller k (exact: ``offline_acceptance``'s
  ``by_k``), and the n-gram simulated at each k, both on the baseline's own greedy outputs.
  Without an offline estimate (no local target, or sampling), the largest-k server's per-position
  counters: AL(k) = 1 + sum of its first k positions' acceptance.
- **the time of a step**: with tokens/s S at concurrency c, the time per step (per request's
  share) is T = AL / S. Served at k, a step runs k draft passes and verifies k + 1 tokens, so
  T(k) grows with k; the smallest and the largest k are served first, and T at the ks between
  is interpolated from the served ks (``step_time``: the line through the two ends at first,
  piecewise once more are served). Not through the baseline: speculation has a fixed cost per
  step the target alone does not pay (on vLLM CPU, a k=1 draft step cost 40% more than a plain
  step, 20% more than the line from the baseline to k=3 said). With one server
  (``verify.sweep_servers: 1``) the baseline is the line's other end all the same.

Parallel drafting (a draft trained with ``train.parallel_depths``, served with vLLM's
``parallel_drafting``) is a third method: all k draft tokens come from ONE draft pass, so its
step time barely grows with k (only the target's verification of k + 1 tokens does). Its sweep
is ``flat``: with one served k the step time is taken as that k's at every k, not the line
from the baseline (which would charge k draft passes); with two or more, the line through them.

Predicted S(k) = AL(k) / T(k). The predicted best k of each concurrency is then served (while
``verify.sweep_servers`` allows) and T interpolated again with it; the prediction made before a
server was started is kept next to what it measured (``checks``). The recommendation is the best
MEASURED k of each concurrency; the report also names a better predicted k that was not served.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

Measure = Callable[[int], tuple[dict[int, float], dict[int, float]]]
"""Serve at k; return ({concurrency: output tokens/s}, {position: acceptance over every window})."""


def step_time(
    k: int, points: Sequence[tuple[int, float]], anchor: float, flat: bool = False
) -> float:
    """T(k) from the served ks' measured step times: exact at a served k, linear between the two
    served ks around k, the line through the nearest two beyond them. With one served k, the line
    through it and (0, ``anchor``) (the baseline, which has no draft overhead).

    Piecewise, not one line fitted to every point: on vLLM CPU the step time jumps from k=1 to
    k=2 and then grows slower (k=2..4 measured 1-21% over the line through k=1 and k=5 in all 8
    sweeps of docs/benchmarks.md "Which k", most at concurrency 8), so a least-squares line
    through the served ks kept predicting k=2 after k=2 was served and measured worse than k=1."""
    pts = sorted(dict(points).items())
    if len(pts) == 1 and flat:  # one draft pass whatever k: the served k's time
        return pts[0][1]
    if len(pts) == 1:
        pts = [(0, anchor), *pts]
    lo = next((i for i in range(len(pts) - 1) if k <= pts[i + 1][0]), len(pts) - 2)
    (k0, t0), (k1, t1) = pts[lo], pts[lo + 1]
    return t0 + (t1 - t0) * (k - k0) / (k1 - k0)


def predict(
    ks: Sequence[int],
    al: dict[int, float],
    measured: dict[int, dict[int, float]],
    base: dict[int, float],
    flat: bool = False,
) -> dict[int, dict[int, float]]:
    """{concurrency: {k: predicted tokens/s}} from the acceptance lengths ``al`` {k: AL}, the
    measured {k: {c: tokens/s}} and the baseline's {c: tokens/s}."""
    out: dict[int, dict[int, float]] = {}
    for c, s_base in base.items():
        points = [(k, al[k] / s[c]) for k, s in sorted(measured.items()) if s.get(c)]
        times = {k: step_time(k, points, 1.0 / s_base, flat) for k in ks}
        out[c] = {k: al[k] / t if t > 0 else 0.0 for k, t in times.items()}
    return out


def best(per_k: dict[int, float]) -> int:
    """The k with the most tokens/s (the smaller k on a tie: cheaper, and less to lose)."""
    return max(sorted(per_k), key=lambda k: (per_k[k], -k))


@dataclass
class MethodSweep:
    """One method's sweep (the draft's or the n-gram's), as the report keeps it."""

    method: str
    ks: list[int]
    acceptance_length: dict[int, float]
    measured: dict[int, dict[int, float]] = field(default_factory=dict)
    served: list[int] = field(default_factory=list)
    checks: list[dict[str, Any]] = field(default_factory=list)
    predicted: dict[int, dict[int, float]] = field(default_factory=dict)
    # vLLM's acceptance length at each served k (its counters): what the gate compares between
    # drafts whose best k differ
    served_acceptance: dict[int, float] = field(default_factory=dict)
    # the ks the stage itself chose to serve (``served`` also holds a bench's measure-all ones)
    stage_served: list[int] = field(default_factory=list)
    flat: bool = False  # parallel drafting: the step time barely grows with k (module doc)

    def best_measured(self) -> dict[int, int]:
        """{concurrency: the served k with the most tokens/s}."""
        cs = sorted({c for s in self.measured.values() for c in s})
        return {c: best({k: s[c] for k, s in self.measured.items() if s.get(c)}) for c in cs}

    def best_predicted(self) -> dict[int, int]:
        return {c: best(p) for c, p in self.predicted.items()}

    def summary_line(self) -> str:
        """tokens/s by k and concurrency, predicted (and measured where served)."""
        per_c = [
            f"c={c}: "
            + ", ".join(
                f"k={k} {p:.1f}"
                + (f" ({self.measured[k][c]:.1f} measured)" if k in self.measured else "")
                for k, p in pred.items()
            )
            for c, pred in self.predicted.items()
        ]
        return (
            f"{self.method} tokens/s by k {'; '.join(per_c)}; best measured {self.best_measured()}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "ks": self.ks,
            "acceptance_length": {str(k): v for k, v in self.acceptance_length.items()},
            "served": self.served,
            "measured_tokens_per_s": _str_keys(self.measured),
            "predicted_tokens_per_s": _str_keys(self.predicted),
            "best_measured": {str(c): k for c, k in self.best_measured().items()},
            "best_predicted": {str(c): k for c, k in self.best_predicted().items()},
            "checks": self.checks,
            "served_acceptance_length": {str(k): v for k, v in self.served_acceptance.items()},
            "served_by_the_stage": self.stage_served or self.served,
            "flat_step_time": self.flat,
        }


def _str_keys(d: dict[int, dict[int, float]]) -> dict[str, dict[str, float]]:
    return {str(a): {str(b): v for b, v in inner.items()} for a, inner in d.items()}


def run_sweep(
    method: str,
    ks: Sequence[int],
    acceptance_length: dict[int, float] | Callable[[dict[int, float]], dict[int, float]],
    base: dict[int, float],
    measure: Measure,
    *,
    servers: int,
    measure_all: bool = False,
    log: Callable[[str], None] = print,
    flat: bool = False,
) -> MethodSweep:
    """Serve the largest and the smallest k, predict every k, serve the predicted best of each
    concurrency while fewer than ``servers`` were served, refitting after each.

    ``measure_all`` (bench/verify_sweep.py): then serve every other k too, against the
    predictions the steps above ended with (kept as ``predicted``: what the stage would have
    chosen from). ``acceptance_length``: {k: AL}, or a function of the largest k's server's
    per-position acceptance (the fallback without an offline estimate)."""
    ks = sorted(ks)
    sweep = MethodSweep(method, list(ks), {}, flat=flat)
    probes = [ks[-1]] if servers < 2 or len(ks) == 1 else [ks[-1], ks[0]]

    def serve(k: int) -> dict[int, float]:
        tps, per_pos = measure(k)
        sweep.measured[k] = tps
        if per_pos:  # no drafts counted: no acceptance length to keep
            sweep.served_acceptance[k] = 1 + sum(per_pos.values())
        sweep.served.append(k)
        return per_pos

    for k in probes:
        per_pos = serve(k)
        if not sweep.acceptance_length:
            sweep.acceptance_length = (
                acceptance_length(per_pos)
                if callable(acceptance_length)
                else dict(acceptance_length)
            )

    def check(k: int) -> None:
        before = {c: p[k] for c, p in sweep.predicted.items()}
        log(
            f"verify: {method} k={k} predicted "
            + ", ".join(f"{v:.1f} tok/s at c={c}" for c, v in before.items())
            + f" (from k={sweep.served}); serving it"
        )
        serve(k)
        for c, p in before.items():
            m = sweep.measured[k].get(c)
            sweep.checks.append(
                {
                    "k": k,
                    "concurrency": c,
                    "predicted": p,
                    "measured": m,
                    "error": p / m - 1 if m else None,
                    "from_ks": sweep.served[:-1],
                }
            )

    while True:
        sweep.predicted = predict(ks, sweep.acceptance_length, sweep.measured, base, flat)
        best_ks = dict.fromkeys(sweep.best_predicted().values())
        todo = [k for k in best_ks if k not in sweep.measured]
        if not todo or len(sweep.served) >= servers:
            break
        check(todo[0])
    sweep.stage_served = list(sweep.served)
    if measure_all:
        for k in reversed(ks):
            if k not in sweep.measured:
                check(k)
    return sweep


def acceptance_from_positions(ks: Sequence[int]) -> Callable[[dict[int, float]], dict[int, float]]:
    """AL(k) = 1 + the first k positions' acceptance of the largest-k server (vLLM's counters):
    the fallback where no offline estimate runs."""

    def f(per_pos: dict[int, float]) -> dict[int, float]:
        return {k: 1 + sum(per_pos.get(i, 0.0) for i in range(k)) for k in ks}

    return f


def best_draft(draft: MethodSweep, parallel: MethodSweep | None) -> dict[int, MethodSweep]:
    """{concurrency: the draft's method (sequential or parallel drafting) whose best measured k
    has the most tokens/s}: the one decision between the two ways of serving the draft (the
    sequential one on a tie: the vLLM path every EAGLE-3 draft runs)."""
    out: dict[int, MethodSweep] = {}
    for c, k in draft.best_measured().items():
        out[c] = draft
        kp = parallel.best_measured().get(c) if parallel else None
        if (
            parallel is not None
            and kp is not None
            and parallel.measured[kp][c] > draft.measured[k][c]
        ):
            out[c] = parallel
    return out


def serving_recommendation(
    draft: MethodSweep,
    ngram: MethodSweep | None,
    base: dict[int, float],
    spec: Callable[[int, bool], dict],
    parallel: MethodSweep | None = None,
) -> dict[str, Any]:
    """What the promoted draft carries: per concurrency, the speculative config of its best
    measured method and k (``spec(k, parallel)``), its tokens/s and speedup, and the n-gram
    baseline at ITS best k."""
    by_c: dict[str, Any] = {}
    nbest = ngram.best_measured() if ngram else {}
    for c, sw in best_draft(draft, parallel).items():
        k = sw.best_measured()[c]
        tps = sw.measured[k][c]
        entry: dict[str, Any] = {
            "method": "parallel" if sw is parallel else "sequential",
            "num_speculative_tokens": k,
            "speculative_config": spec(k, sw is parallel),
            "tokens_per_s": tps,
            "speedup": tps / base[c] if base.get(c) else None,
            "predicted_best_k": sw.best_predicted().get(c),
        }
        if parallel is not None:  # the other way of serving the draft, at its best k
            other = draft if sw is parallel else parallel
            ko = other.best_measured().get(c)
            if ko is not None:
                entry["other_method"] = {
                    "method": "sequential" if sw is parallel else "parallel",
                    "num_speculative_tokens": ko,
                    "tokens_per_s": other.measured[ko][c],
                }
        if ngram and c in nbest:
            nk = nbest[c]
            ntps = ngram.measured[nk][c]
            entry["ngram"] = {
                "num_speculative_tokens": nk,
                "tokens_per_s": ntps,
                "speedup": ntps / base[c] if base.get(c) else None,
            }
            entry["draft_over_ngram"] = tps / ntps if ntps else None
        by_c[str(c)] = entry
    return by_c
