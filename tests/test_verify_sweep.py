"""The k sweep's prediction (eagle3/verify/sweep.py) on servers simulated by the model it assumes
(no vLLM: the real sweep runs in tests/test_verify.py and the hero run's test): acceptance for
every k known, a step time linear in k with a fixed overhead the baseline does not pay, and the
jump from k=1 to k=2 vLLM CPU showed (docs/benchmarks.md "Which k")."""

from __future__ import annotations

import pytest

from eagle3.verify.sweep import (
    acceptance_from_positions,
    best,
    predict,
    run_sweep,
    serving_recommendation,
    step_time,
)

KS = [1, 2, 3, 4, 5]
AL = {1: 1.7, 2: 2.1, 3: 2.35, 4: 2.45, 5: 2.5}  # diminishing returns, as drafts have
BASE = {1: 40.0, 8: 160.0}


def step(c: int, k: int, over: dict, per: dict, jump: dict | None = None) -> float:
    """A simulated server's step time at k: 1/S_base + overhead + per_k * k (+ a jump from k=2)."""
    return 1 / BASE[c] + over[c] + per[c] * k + ((jump or {}).get(c, 0.0) if k >= 2 else 0.0)


def server(overhead: dict[int, float], per_k: dict[int, float], jump: dict | None = None):
    """tokens/s of a simulated server at k (``step``), and its per-position acceptance."""
    served = []

    def measure(k: int):
        served.append(k)
        tps = {c: AL[k] / step(c, k, overhead, per_k, jump) for c in BASE}
        return tps, {i: AL[i + 1] - AL.get(i, 1.0) for i in range(k)}

    return measure, served


def test_step_time_and_predict():
    assert step_time(3, [(3, 0.05)], 0.02) == pytest.approx(0.05)
    assert step_time(2, [(3, 0.05)], 0.02) == pytest.approx(0.04)  # the line from the anchor
    pts = [(1, 0.03), (2, 0.05), (5, 0.08)]  # exact where served, piecewise between, no anchor
    assert [step_time(k, pts, 1.0) for k in (1, 2, 3, 5)] == pytest.approx([0.03, 0.05, 0.06, 0.08])
    assert step_time(7, pts, 1.0) == pytest.approx(0.10)  # beyond: the nearest two's line
    pred = predict([1, 3], {1: 2.0, 3: 3.0}, {3: {1: 3.0 / 0.07}}, {1: 1 / 0.01})
    assert pred[1][3] == pytest.approx(3.0 / 0.07) and pred[1][1] == pytest.approx(2.0 / 0.03)
    assert best({1: 10.0, 2: 12.0, 3: 12.0}) == 2  # a tie goes to the smaller k


def truth(over: dict, per: dict, jump: dict | None = None) -> dict[int, dict[int, float]]:
    return {c: {k: AL[k] / step(c, k, over, per, jump) for k in KS} for c in BASE}


def test_two_ends_predict_every_k_and_the_best_is_served():
    """The smallest and the largest k served first: a step time linear in k (with a fixed
    overhead the baseline does not pay) is then known exactly, every k's tokens/s predicted
    exactly, and the predicted best of each concurrency is served as the check."""
    over, per = {1: 0.008, 8: 0.002}, {1: 0.002, 8: 0.001}
    measure, served = server(over, per)
    sw = run_sweep("draft", KS, AL, BASE, measure, servers=3, log=lambda m: None)
    want = truth(over, per)
    assert served[:2] == [5, 1]
    for c in BASE:
        assert sw.predicted[c] == pytest.approx(want[c])
        assert sw.best_predicted()[c] == best(want[c])
    assert best(want[1]) in served and all(abs(ch["error"]) < 1e-9 for ch in sw.checks)
    assert sw.best_measured()[1] == best(want[1])
    # vLLM's acceptance at every served k, kept for the gate's comparison across drafts
    assert sw.served_acceptance == pytest.approx({k: AL[k] for k in served})


def test_one_server_leans_on_the_baseline_and_reports_its_error():
    """``verify.sweep_servers: 1`` fits through the baseline and the largest k: blind to the fixed
    overhead, its prediction is off, and the check server of a bench run says by how much."""
    over, per = {1: 0.008, 8: 0.002}, {1: 0.002, 8: 0.001}
    measure, served = server(over, per)
    sw = run_sweep("draft", KS, AL, BASE, measure, servers=1, log=lambda m: None)
    assert served == [5] and not sw.checks
    every = run_sweep("draft", KS, AL, BASE, server(over, per)[0], servers=1, measure_all=True)
    assert sorted(every.measured) == KS  # the bench's mode: every k served, one prediction
    assert len(every.checks) == 2 * 4 and any(ch["error"] > 0.05 for ch in every.checks)
    rec = serving_recommendation(
        every, every, BASE, lambda k, _par: {"method": "eagle3", "num_speculative_tokens": k}
    )
    want = truth(over, per)
    for c in BASE:
        e = rec[str(c)]
        assert e["num_speculative_tokens"] == best(want[c])
        assert e["speculative_config"]["num_speculative_tokens"] == e["num_speculative_tokens"]
        assert e["speedup"] == pytest.approx(e["tokens_per_s"] / BASE[c])
        assert e["draft_over_ngram"] == pytest.approx(1.0)


def test_acceptance_from_the_largest_k_counters():
    """Without an offline estimate: AL(k) = 1 + the largest-k server's first k positions."""
    al = acceptance_from_positions([1, 2, 3])({0: 0.6, 1: 0.3, 2: 0.1})
    assert al == pytest.approx({1: 1.6, 2: 1.9, 3: 2.0})
    measure, _ = server({1: 0.0, 8: 0.0}, {1: 0.004, 8: 0.0015})
    sw = run_sweep("draft", KS, acceptance_from_positions(KS), BASE, measure, servers=1)
    assert sw.acceptance_length == pytest.approx(AL) and sw.served == [5]


def test_a_jump_after_k1_is_caught_by_serving_the_predicted_best():
    """vLLM CPU at concurrency 8: the step time jumps from k=1 to k=2 (up to 21% over the line
    through k=1 and k=5). The line predicts k=2; served, k=2 measures worse than k=1, and the
    step time interpolated through k=1, 2 and 5 then predicts k=1, the true best. The check
    keeps how far the two-server prediction was off."""
    over, per, jump = {1: 0.008, 8: 0.002}, {1: 0.008, 8: 0.001}, {1: 0.0, 8: 0.004}
    want = truth(over, per, jump)
    assert best(want[1]) == 2 and best(want[8]) == 1
    measure, served = server(over, per, jump)
    sw = run_sweep("draft", KS, AL, BASE, measure, servers=4, log=lambda m: None)
    assert served == [5, 1, 2] and sw.stage_served == served  # then nothing left to check
    (ch,) = [ch for ch in sw.checks if ch["concurrency"] == 8]
    assert ch["k"] == 2 and ch["error"] > 0.2 and ch["from_ks"] == [5, 1]
    for c in BASE:
        assert sw.best_predicted()[c] == best(want[c])
        assert sw.predicted[c][2] == pytest.approx(want[c][2])  # exact where served


def test_parallel_drafting_is_flat_and_the_faster_way_is_served():
    """A parallel-drafting sweep served at one k predicts every k from that k's step time (one
    draft pass whatever k), not from the line to the baseline; per concurrency the draft's faster
    way wins, and serving.json's config then carries parallel_drafting."""
    assert step_time(2, [(4, 0.05)], 0.02, flat=True) == pytest.approx(0.05)
    par_al = {1: 1.7, 2: 2.2, 3: 2.6, 4: 2.9}  # the parallel draft keeps accepting further out
    seq_measure, _ = server({1: 0.008, 8: 0.002}, {1: 0.004, 8: 0.001})

    def par_measure(k: int):  # a flat step: one draft pass, the verification of k + 1 tokens
        t = {1: 1 / BASE[1] + 0.010 + 0.0005 * k, 8: 1 / BASE[8] + 0.002 + 0.002 * k}
        return {c: par_al[k] / t[c] for c in BASE}, {}

    seq = run_sweep("draft", KS, AL, BASE, seq_measure, servers=2, log=lambda _m: None)
    par = run_sweep(
        "parallel", [1, 2, 3, 4], par_al, BASE, par_measure, servers=1, flat=True,
        log=lambda _m: None,
    )  # fmt: skip
    assert par.served == [4] and par.predicted[1][2] == pytest.approx(
        par_al[2] / (par_al[4] / par.measured[4][1])
    )
    spec = lambda k, p: {"num_speculative_tokens": k, **({"parallel_drafting": True} if p else {})}  # noqa: E731
    rec = serving_recommendation(seq, None, BASE, spec, par)
    for c in ("1", "8"):
        e = rec[c]
        k_seq = seq.best_measured()[int(c)]
        faster_par = par.measured[4][int(c)] > seq.measured[k_seq][int(c)]
        assert e["method"] == ("parallel" if faster_par else "sequential")
        assert e["speculative_config"].get("parallel_drafting", False) == faster_par
        assert e["other_method"]["method"] == ("sequential" if faster_par else "parallel")
    assert rec["1"]["method"] == "parallel"  # c=1: the flat step pays at k=4
    assert rec["8"]["method"] == "sequential"  # c=8: verification costs grow, k=1 sequential wins


def test_parallel_ks_follow_the_trained_depths(tmp_path):
    """The sweep serves parallel drafting from k = 2 (k = 1 is the sequential pass) up to the
    depths the draft was trained for; a sequential draft or verify.parallel_drafting off: none."""
    import json

    from eagle3.config import load_config
    from eagle3.verify.arms import parallel_ks

    cfg = load_config("configs/smollm2-cpu.yaml", ["verify.num_speculative_tokens=[1, 2, 3, 4, 5]"])
    (tmp_path / "config.json").write_text(
        json.dumps({"ptd_token_id": 2, "parallel_drafting_depths": 3})
    )
    assert parallel_ks(cfg, tmp_path) == [2, 3]
    off = cfg.model_copy(
        update={"verify": cfg.verify.model_copy(update={"parallel_drafting": "off"})}
    )
    assert parallel_ks(off, tmp_path) == []
    (tmp_path / "config.json").write_text(json.dumps({"draft_vocab_size": 8}))
    assert parallel_ks(cfg, tmp_path) == []


def test_an_ngram_sweep_that_failed_reports_no_ngram_numbers():
    """The n-gram's k = 1 server served, its k = 3 server died: the sweep raised (reported as
    "not measured"), so the report carries no n-gram windows, not those of the k = 1 server."""
    from eagle3.verify.arms import ngram_arm
    from eagle3.verify.sweep import MethodSweep

    first = ([("k=1 windows",)], {"ready_s": 20.0})
    servers = {("draft", 1): ([], {}), ("ngram", 1): first}
    assert ngram_arm(servers, None, 1) == (None, None)
    done = MethodSweep("n-gram", [1, 3], {1: 1.2, 3: 1.5})
    assert ngram_arm(servers, done, 1) == first
