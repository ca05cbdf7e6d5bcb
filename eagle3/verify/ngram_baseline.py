"""The n-gram baseline's part of the verify report (prompt lookup: the free baseline a draft must
beat), and the draft against it."""

from __future__ import annotations

from typing import Any

from eagle3.verify.client import compare_outputs
from eagle3.verify.compare import outputs_summary, window_stats
from eagle3.verify.metrics import Snapshot
from eagle3.verify.ngram import simulate_ngram, vllm_ngram_config


def ngram_speculative_config(cfg: Any) -> dict[str, Any]:
    """The ``--speculative-config`` of the n-gram baseline server (same k as the draft)."""
    v = cfg.verify
    return vllm_ngram_config(v.k, v.ngram_prompt_lookup_min, v.ngram_prompt_lookup_max)


def _sim_vs_counters(sim: dict[str, Any], delta: Snapshot) -> dict[str, Any]:
    """The simulation on the n-gram server's own outputs next to that server's counters."""
    al = 1 + delta.accepted / delta.drafts if delta.drafts else None
    sal = sim["acceptance_length_proposing"]
    return {
        "drafts": {"simulated": sim["proposing_chains"], "vllm": delta.drafts},
        "draft_tokens": {"simulated": sim["proposed_tokens"], "vllm": delta.draft_tokens},
        # vLLM also counts tokens it accepted past max_tokens / a stop token before cutting the
        # output
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
    k, lo, hi = v.k, v.ngram_prompt_lookup_min, v.ngram_prompt_lookup_max
    greedy = v.temperature == 0
    total = Snapshot()
    out_windows = []
    seqs_all: list[tuple[list[int], list[int]]] = []
    for w, (brun, _, _), (nrun, n0, n1) in zip(windows, base, ngramw):
        ns = window_stats(nrun, n0, n1)
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
        "outputs": outputs_summary(out_windows, greedy),
        "simulated": {**sim, "vs_vllm": _sim_vs_counters(sim, total)},
        "server": info,
    }


def versus_ngram(
    acceptance_length: float | None, windows: list[dict[str, Any]], ngram: dict[str, Any]
) -> dict[str, Any] | None:
    """Draft vs n-gram baseline at the lowest concurrency (None when the baseline was not
    measured).

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
