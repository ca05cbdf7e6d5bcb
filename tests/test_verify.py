"""Verify stage: counters, workload, gate, offline estimate; and the real thing on vLLM CPU
(baseline server, then target + the pipeline's own trained draft with speculative decoding)."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch

from eagle3.verify.gate import GateFailed, evaluate_gate, last_promoted, promote
from eagle3.verify.metrics import Snapshot, parse_prometheus
from eagle3.verify.offline import chains_of_sequence, summarize_chains
from eagle3.verify.workload import WorkloadError, load_workload, workload_fingerprint

PROMPTS = Path(__file__).parent / "data" / "verify-prompts.jsonl"

METRICS = """# HELP vllm:spec_decode_num_drafts Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7e9
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 30.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 12.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 7.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 4.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 1.0
vllm:generation_tokens_total{engine="0",model_name="m"} 50.0
vllm:request_time_per_output_token_seconds_sum{engine="0",model_name="m"} 0.5
vllm:request_time_per_output_token_seconds_count{engine="0",model_name="m"} 5.0
"""


def test_counters_parse_and_delta():
    s = parse_prometheus(METRICS)
    assert s[("vllm:spec_decode_num_drafts_total", (("engine", "0"), ("model_name", "m")))] == 10.0
    after = Snapshot.from_text(METRICS)
    before = Snapshot.from_text(
        'vllm:spec_decode_num_drafts_total{engine="0"} 4\nvllm:spec_decode_num_draft_tokens_total{engine="0"} 12\n'
        'vllm:spec_decode_num_accepted_tokens_total{engine="0"} 3\n'
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="0"} 2\n'
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="1"} 1\n'
    )
    d = (after - before).summary()
    assert d["acceptance_length"] == pytest.approx(1 + 9 / 6)
    assert d["acceptance_rate"] == pytest.approx(9 / 18)
    assert d["acceptance_per_position"] == pytest.approx([5 / 6, 3 / 6, 1 / 6])
    full = after.summary()
    assert full["acceptance_length"] == pytest.approx(2.2) and full["acceptance_per_position"] == [
        0.7,
        0.4,
        0.1,
    ]
    assert full["server_mean_tpot_s"] == pytest.approx(0.1)
    assert Snapshot().summary()["acceptance_length"] is None


def test_workload_mt_bench_and_files(tmp_path):
    mt = load_workload("mt_bench")
    assert len(mt) == 80 and all(len(c.turns) == 2 for c in mt)
    assert len(load_workload("mt_bench", num_prompts=5, turns=1)) == 5
    convs = load_workload(str(PROMPTS))
    assert [len(c.turns) for c in convs] == [2, 2, 1] and convs[0].id == "capital"
    assert workload_fingerprint(convs) == workload_fingerprint(load_workload(str(PROMPTS)))
    assert workload_fingerprint(convs) != workload_fingerprint(convs[:2])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"turns": ["ok"]}\n{"turns": [\n')
    with pytest.raises(WorkloadError, match="bad.jsonl:2: not valid JSON"):
        load_workload(str(bad))
    bad.write_text('{"turns": []}\n')
    with pytest.raises(WorkloadError, match="row 1 has no usable"):
        load_workload(str(bad))


def test_gate_and_promotion(tmp_path):
    cond = {
        "workload_fingerprint": "w",
        "num_speculative_tokens": 3,
        "temperature": 0.0,
        "max_tokens": 64,
    }
    kw = dict(min_acceptance_length=1.5, max_regression=0.05)
    assert evaluate_gate(2.0, cond, None, **kw).passed
    low = evaluate_gate(1.2, cond, None, **kw)
    assert not low.passed and "1.200 < minimum 1.5" in low.reasons[0]
    none = evaluate_gate(None, cond, None, **kw)
    assert not none.passed and "spec_decode_num_drafts" in none.reasons[0]

    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text("{}")
    dest = promote(draft, tmp_path / "runs", "p", {**cond, "acceptance_length": 2.0, "key": "k1"})
    prev = last_promoted(tmp_path / "runs", "p")
    assert prev["acceptance_length"] == 2.0 and Path(prev["draft"]) == dest
    assert (tmp_path / "runs/promoted/p/latest").resolve() == dest.resolve()
    worse = evaluate_gate(1.85, cond, prev, **kw)
    assert not worse.passed and "more than 5% below" in worse.reasons[0]
    assert evaluate_gate(1.95, cond, prev, **kw).passed
    other = evaluate_gate(1.6, {**cond, "num_speculative_tokens": 5}, prev, **kw)
    assert other.passed and "not comparable" in other.checks["previous"]
    mism = evaluate_gate(2.0, cond, None, **kw, mismatch_fraction=0.5, max_mismatch_fraction=0.1)
    assert not mism.passed and "differ from the baseline" in mism.reasons[0]


def test_gate_compares_at_a_k_both_drafts_served():
    """After a k sweep the best k can move between drafts: the gate compares vLLM's acceptance
    at the last draft's k when this one was served at it too, else at a k both were."""
    base = {"workload_fingerprint": "w", "temperature": 0.0, "max_tokens": 64}
    prev = {
        **base,
        "num_speculative_tokens": 2,
        "acceptance_length": 1.8,
        "acceptance_by_k": {"1": 1.5, "2": 1.8},
        "draft": "d0",
    }
    kw = dict(min_acceptance_length=1.0, max_regression=0.05)
    # best k moved to 1; at the last draft's k=2 it is no worse
    moved = {**base, "num_speculative_tokens": 1, "acceptance_by_k": {"1": 1.3, "2": 1.85}}
    g = evaluate_gate(1.3, moved, prev, **kw)
    assert g.passed and g.checks["previous"]["num_speculative_tokens"] == 2
    assert g.checks["previous"]["this_draft"] == 1.85
    # served at k=1 only (a single-k verify): compared there, and worse
    worse = evaluate_gate(1.3, {**base, "num_speculative_tokens": 1}, prev, **kw)
    assert not worse.passed and "1.300 at k=1" in worse.reasons[0]
    assert "1.500 at k=1" in worse.reasons[0]
    # a k neither served, or another max_tokens: not comparable
    for cur in ({**base, "num_speculative_tokens": 4}, {**moved, "max_tokens": 128}):
        assert "not comparable" in evaluate_gate(1.3, cur, prev, **kw).checks["previous"]


class OracleDraft:
    """A stand-in draft that 'predicts' from a known sequence: right for the first ``right``
    positions of each chain, wrong after (exercises the chain bookkeeping exactly)."""

    def __init__(self, seq: torch.Tensor, vocab: int, right: int) -> None:
        self.seq, self.vocab, self.right = seq, vocab, right

    def __call__(self, input_ids, hidden, position_ids=None, past_kv=None, use_cache=False):
        t = input_ids.shape[1]
        pos = torch.arange(t) if position_ids is None else position_ids.view(-1)
        # chain step index: chain calls return ones as their "keys", the prefix pass zeros
        step = torch.full((t,), 0 if past_kv is None else int(past_kv[0].sum()) + 1)
        logits = torch.zeros(1, t, self.vocab)
        for j, p in enumerate(pos.tolist()):
            nxt = int(self.seq[p + 2]) if p + 2 < self.seq.numel() else 0
            ok = int(step[j]) < self.right
            logits[0, j, nxt if ok else (nxt + 1) % self.vocab] = 1.0
        mark = torch.zeros if past_kv is None else torch.ones
        kv = (mark(1, 1, t, 1), mark(1, 1, t, 1))
        return torch.zeros(1, t, 4), logits, kv


@pytest.mark.parametrize("right,k,expect", [(3, 3, 4.0), (0, 3, 1.0), (1, 3, 2.0), (2, 4, 3.0)])
def test_offline_chains(right, k, expect):
    seq = torch.arange(40) % 17
    accepted = chains_of_sequence(
        OracleDraft(seq, 17, right), torch.zeros(40, 3), seq, 9, k, torch.arange(17)
    )
    s = summarize_chains(accepted, k)
    # every chain but possibly the last (cut at the end of the sequence) accepts min(right, k)
    assert all(a == min(right, k) for a in accepted[:-1])
    assert s["acceptance_length"] == pytest.approx(expect, abs=0.5)
    assert sum(a + 1 for a in accepted) <= 40 - 9


def test_gate_require_beat_ngram():
    cond = {
        "workload_fingerprint": "w",
        "num_speculative_tokens": 3,
        "temperature": 0.0,
        "max_tokens": 64,
    }
    kw = dict(min_acceptance_length=1.0, max_regression=0.05)
    vs = {
        "concurrency": 1,
        "draft": {"acceptance_length": 2.1, "speedup": 1.3},
        "ngram": {"acceptance_length": 2.0, "acceptance_length_all_steps": 1.7, "speedup": 1.1},
    }
    ok = evaluate_gate(2.1, cond, None, **kw, require_beat_ngram=True, versus_ngram=vs)
    assert ok.passed and ok.checks["beats_ngram"] is True
    slow = {**vs, "draft": {"acceptance_length": 2.1, "speedup": 1.05}}
    g = evaluate_gate(2.1, cond, None, **kw, require_beat_ngram=True, versus_ngram=slow)
    assert not g.passed and g.reasons == [
        "speedup at concurrency 1 x1.050 does not exceed the n-gram baseline's x1.100"
    ]
    short = {**vs, "draft": {"acceptance_length": 1.9, "speedup": 1.3}}
    g = evaluate_gate(1.9, cond, None, **kw, require_beat_ngram=True, versus_ngram=short)
    assert (
        not g.passed
        and "acceptance length 1.900 does not exceed the n-gram baseline's 2.000" in g.reasons[0]
    )
    assert "1.700 over all steps" in g.reasons[0]
    # not required: reported in the checks only
    info = evaluate_gate(1.9, cond, None, **kw, versus_ngram=short)
    assert info.passed and info.checks["beats_ngram"] is False
    missing = evaluate_gate(
        2.1,
        cond,
        None,
        **kw,
        require_beat_ngram=True,
        versus_ngram=None,
        ngram_reason="serve.backend external: no verify.ngram_base_url",
    )
    assert not missing.passed and "not measured (serve.backend external" in missing.reasons[0]
    assert evaluate_gate(2.1, cond, None, **kw).checks["require_beat_ngram"] is False


def _run(concurrency, seqs, tok_s):
    from eagle3.verify.client import TurnResult, WorkloadRun

    results = [TurnResult(f"c{i}", 0, p, o, "", "length", 1.0) for i, (p, o) in enumerate(seqs)]
    return WorkloadRun(concurrency, sum(len(o) for _, o in seqs) / tok_s, results)


def test_ngram_section_report_and_plot(tmp_path):
    """The n-gram part of the report from client runs and counters (no server): vLLM's figures,
    the simulation over the server's own outputs next to them, speedups, markdown and plot."""
    from eagle3.config import load_config
    from eagle3.verify.ngram import ngram_chains
    from eagle3.verify.plot import plot
    from eagle3.verify.report import render_markdown
    from eagle3.verify.runner import ngram_section, versus_ngram
    from tests.conftest import CPU_PROFILE

    cfg = load_config(CPU_PROFILE, ["verify.concurrency=[1, 4]", "verify.num_speculative_tokens=3"])
    seqs = [([1, 2, 3], [4, 1, 2, 3, 9, 9]), ([10, 11, 12, 13, 14], [10, 11, 12, 13, 14] * 4)]
    chains = [ngram_chains(p, o, 3) for p, o in seqs]
    props = [c for ch in chains for c, n in zip(ch, ch.proposed) if n]
    per_pos = {i: float(sum(1 for a in props if a > i)) for i in range(3)}
    # counters as a vLLM that proposes exactly like the simulation would show them
    n0 = Snapshot()
    n1 = Snapshot(
        drafts=len(props),
        draft_tokens=sum(n for ch in chains for n in ch.proposed),
        accepted=sum(props),
        accepted_per_pos=per_pos,
        generation_tokens=sum(len(o) for _, o in seqs),
    )
    base = [(_run(c, seqs, 10.0), Snapshot(), Snapshot()) for c in (1, 4)]
    ngramw = [(_run(c, seqs, 15.0), n0, n1) for c in (1, 4)]
    windows = [
        {
            "concurrency": c,
            "baseline": {"output_tokens_per_s": 10.0, "server_mean_tpot_s": None},
            "speculative": {
                "output_tokens_per_s": 12.0,
                "acceptance_length": 1.5,
                "server_mean_tpot_s": None,
            },
            "speedup": 1.2,
            "tpot_ratio": None,
            "outputs": None,
        }
        for c in (1, 4)
    ]
    ng = ngram_section(cfg, windows, base, ngramw, {"ready_s": 40.0}, None)
    assert ng["measured"] and ng["speculative_config"] == {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 1,
    }
    assert ng["speedup"] == {"1": pytest.approx(1.5), "4": pytest.approx(1.5)}
    assert ng["acceptance_length"] == pytest.approx(
        1 + sum(props) / len(props)
    )  # vLLM: proposing steps
    assert (
        ng["acceptance_length_all_steps"] < ng["acceptance_length"]
    )  # the first sequence has empty steps
    sv = ng["windows"][0]["simulated_vs_vllm"]
    assert (
        sv["drafts"]["simulated"] == sv["drafts"]["vllm"]
        and sv["accepted"]["simulated"] == sv["accepted"]["vllm"]
    )
    assert sv["acceptance_length_proposing"]["difference"] == pytest.approx(0)
    assert (
        ng["outputs"]["compared"] == 4 and ng["outputs"]["mismatches"] == 0
    )  # greedy: same tokens as the baseline
    vs = versus_ngram(1.5, windows, ng)
    assert (
        vs["concurrency"] == 1
        and vs["draft"]["speedup"] == 1.2
        and vs["ngram"]["speedup"] == pytest.approx(1.5)
    )
    assert not evaluate_gate(
        1.5,
        {},
        None,
        min_acceptance_length=1,
        max_regression=0.05,
        require_beat_ngram=True,
        versus_ngram=vs,
    ).passed

    report = {
        "profile": "p",
        "draft_dir": "d",
        "num_speculative_tokens": 3,
        "temperature": 0.0,
        "max_tokens": 64,
        "workload": {"name": "w", "conversations": 2, "turns": 1, "fingerprint": "f"},
        "acceptance": {
            "acceptance_length": 1.5,
            "acceptance_rate": 0.2,
            "acceptance_per_position": [0.3, 0.15, 0.05],
        },
        "windows": windows,
        "offline": None,
        "ngram": ng,
        "versus_ngram": vs,
        "gate": {"passed": True, "reasons": [], "checks": {"beats_ngram": False}},
        "promoted": None,
        "servers": {
            "baseline": {"ready_s": 40.0},
            "speculative": {"ready_s": 41.0},
            "ngram": {"ready_s": 40.0},
        },
    }
    md = render_markdown(report)
    assert (
        "## N-gram baseline (prompt lookup) vs the draft" in md and "draft beats n-gram: no" in md
    )
    assert (
        f"| acceptance length | 1.500 | {ng['acceptance_length']:.3f} | {ng['acceptance_length_all_steps']:.3f} |"
        in md
    )
    assert "| 4 | 10.0 | 12.0 | 1.200 | 15.0 | 1.500 |" in md and "n-gram in 40.0 s" in md
    assert plot(report, tmp_path / "r.png").stat().st_size > 0
    # what the hero run (make demo) prints next to the draft's acceptance length, from report.json
    from flows.hero_run import ngram_summary

    (tmp_path / "report.json").write_text(json.dumps(report))
    line = ngram_summary(str(tmp_path))
    assert (
        line.startswith(
            f"acceptance length {round(ng['acceptance_length_all_steps'], 4)} over all steps "
            f"({round(ng['acceptance_length'], 4)} in vLLM's count"
        )
        and "'1': 1.5" in line
    )
    assert ngram_summary(str(tmp_path / "missing")) is None
    off = ngram_section(
        cfg, windows, base, None, None, "serve.backend external: no verify.ngram_base_url"
    )
    assert not off["measured"] and versus_ngram(1.5, windows, off) is None
    assert "n-gram baseline: not measured (serve.backend external" in render_markdown(
        {**report, "ngram": off, "versus_ngram": None}
    )


def _check_the_sweep_choice(r: dict, out: Path) -> dict[tuple[str, str], int]:
    """The k sweep's choice on real servers (ks 1, 2, 3; two servers per method): each method was
    served at its two ends (k = 3, then k = 1) and k = 2 only predicted between them; what the
    report recommends at each concurrency is the served k with the most tokens/s in the report's
    own measurements; k = 2 is reported as predicted, not measured. Returns {(method,
    concurrency): best measured k}."""
    from eagle3.verify.report import fmt

    md = (out / "report.md").read_text()
    best: dict[tuple[str, str], int] = {}
    for name in ("draft", "ngram"):
        sw = r["sweep"][name]
        meas, al = sw["measured_tokens_per_s"], sw["acceptance_length"]
        assert sw["served"] == [3, 1] and set(meas) == {"1", "3"} and not sw["checks"], sw
        for c in ("1", "3"):
            # the most tokens/s measured (the smaller k on a tie, as documented)
            best[name, c] = max((1, 3), key=lambda kk, c=c: (meas[str(kk)][c], -kk))
            assert sw["best_measured"][c] == best[name, c], (name, c, meas)
            pred = sw["predicted_tokens_per_s"][c]
            assert set(pred) == {"1", "2", "3"}  # every k predicted, served or not
            # exact where served; k = 2 on the line between the two served step times
            assert pred["1"] == pytest.approx(meas["1"][c]) and pred["3"] == pytest.approx(
                meas["3"][c]
            )
            t1, t3 = al["1"] / meas["1"][c], al["3"] / meas["3"][c]
            assert pred["2"] == pytest.approx(al["2"] / ((t1 + t3) / 2))
            for kk in (1, 2, 3):  # an unserved best predicted k is named, a served one is not
                said = f"- {name} at concurrency {c}: k = {kk} was predicted best" in md
                assert said == (sw["best_predicted"][c] == kk == 2), (name, c, kk)
        # k = 2's row of the method's table: its predicted tokens/s, no measurement
        p2 = [fmt(sw["predicted_tokens_per_s"][c]["2"], 1) for c in ("1", "3")]
        assert f"| 2 | {fmt(al['2'])} | {p2[0]} | - | {p2[1]} | - |" in md, name
    assert r["num_speculative_tokens"] == best["draft", "1"]
    assert r["sweep"]["ngram_num_speculative_tokens"] == best["ngram", "1"]
    assert r["ngram"]["speculative_config"]["num_speculative_tokens"] == best["ngram", "1"]
    for c, e in r["serving"].items():
        assert e["num_speculative_tokens"] == best["draft", c]
        assert (
            e["tokens_per_s"]
            == r["sweep"]["draft"]["measured_tokens_per_s"][str(best["draft", c])][c]
        )
        assert e["ngram"]["num_speculative_tokens"] == best["ngram", c]
    return best


@pytest.mark.vllm
def test_verify_on_vllm(trained_draft, smol_model, tmp_path, request):
    """Baseline, then a k sweep (k = 1, 2, 3, two servers per method: k = 3 and k = 1, CI's
    time; the checks of a predicted best are tests/test_verify_sweep.py's) of target + the
    trained draft and of target + n-gram: the choice is the best measured k, the report's numbers
    at the chosen k are the raw counters' numbers, k = 2 is predicted from the offline estimate
    and the two served step times, and the promoted draft's serving config serves. Then a worse
    draft (the same, its lm_head negated) is refused by the gate against the promoted one."""
    from eagle3.verify import verify
    from tests.conftest import gen_cfg

    # float32 servers: speculative decoding must then leave greedy output exactly unchanged (in bf16
    # the 4-token verification GEMMs round differently from 1-token decode steps, and near-tied
    # logits flip: docs/verify.md)
    cfg = gen_cfg(
        tmp_path,
        f"verify.workload={PROMPTS}",
        "verify.max_tokens=32",
        "verify.concurrency=[1, 3]",
        "verify.warmup_requests=1",
        "serve.port=0",
        "serve.dtype=float32",
        "verify.min_acceptance_length=1.0",
        "verify.num_speculative_tokens=[1, 2, 3]",
        "verify.sweep_servers=2",
    )  # a 2-epoch draft on 8 samples: barely above 1
    r = verify(cfg, str(smol_model), trained_draft, tmp_path / "verify")
    out = tmp_path / "verify"
    assert json.loads((out / "report.json").read_text()) == json.loads(json.dumps(r))
    assert (out / "report.png").stat().st_size > 0 and "mean acceptance length" in (
        out / "report.md"
    ).read_text()

    best = _check_the_sweep_choice(r, out)
    k = r["num_speculative_tokens"]  # the draft's best measured k at concurrency 1
    kn = r["sweep"]["ngram_num_speculative_tokens"]
    assert set(r["offline"]["by_k"]) == {1, 2, 3} and r["offline"]["k"] == k
    assert (
        r["sweep"]["draft"]["acceptance_length"]["2"]
        == r["offline"]["by_k"][2]["acceptance_length"]
    )
    assert sorted(p.name for p in (out / "logs").iterdir() if p.is_dir()) == [
        "draft-k1",
        "draft-k3",
        "ngram-k1",
        "ngram-k3",
    ]
    total_drafts = total_acc = 0.0
    for w in r["windows"]:
        for side in ("baseline", "speculative"):
            s = w[side]
            before, after = s["counters"]["before"], s["counters"]["after"]
            # the server generated exactly the tokens the client received
            assert (
                after["generation_tokens"] - before["generation_tokens"] == s["output_tokens"] > 0
            )
            assert s["requests"] == 5
        s = w["speculative"]
        b, a = s["counters"]["before"], s["counters"]["after"]
        drafts, acc = a["drafts"] - b["drafts"], a["accepted"] - b["accepted"]
        assert drafts > 0 and a["draft_tokens"] - b["draft_tokens"] == k * drafts
        assert s["acceptance_length"] == pytest.approx(1 + acc / drafts)
        assert s["acceptance_rate"] == pytest.approx(acc / (a["draft_tokens"] - b["draft_tokens"]))
        per = [
            a["accepted_per_pos"][str(i)] - b["accepted_per_pos"].get(str(i), 0) for i in range(k)
        ]
        assert s["acceptance_per_position"] == pytest.approx([p / drafts for p in per])
        assert sum(per) == acc
        assert w["speedup"] == pytest.approx(
            s["output_tokens_per_s"] / w["baseline"]["output_tokens_per_s"]
        )
        assert w["baseline"]["counters"]["after"]["drafts"] == 0  # the baseline has no draft
        total_drafts, total_acc = total_drafts + drafts, total_acc + acc
    assert r["acceptance_length"] == pytest.approx(1 + total_acc / total_drafts)
    assert 1 < r["acceptance_length"] <= 1 + k
    assert r["outputs"]["compared"] == 10 and r["outputs"]["mismatches"] == 0, r["windows"]
    assert r["windows"][1]["baseline_vs_first_window"]["mismatches"] == 0
    assert len((out / "outputs" / "speculative-c3.jsonl").read_text().splitlines()) == 5
    # How vLLM loaded the export (its own log lines): the embedding is not in the export, so vLLM
    # shares the target's and keeps our lm_head; the auxiliary layer ids reached the target.
    spec_log = next(
        p.read_text()
        for p in sorted((out / "logs" / f"draft-k{k}").glob("*.log"))
        if "--speculative-config" in p.read_text()
    )
    assert "without its own embed_tokens" in spec_log and "distinct lm_head" in spec_log, spec_log[
        -3000:
    ]
    assert "(2, 15, 27)" in spec_log
    print(
        f"\nverify: acceptance length {r['acceptance_length']:.3f}, per position "
        f"{[round(x, 3) for x in r['acceptance']['acceptance_per_position']]}, speedup {r['speedup']}, "
        f"greedy mismatches {r['outputs']['mismatches']}/{r['outputs']['compared']}, offline "
        f"{r['offline']['acceptance_length']:.3f} (diff {r['offline']['difference_from_vllm']:+.3f})"
    )
    assert r["offline"]["chains"] > 0 and math.isfinite(r["offline"]["difference_from_vllm"])
    assert (
        r["offline"]["ngram"]["chains"] > 0
    )  # the n-gram simulated on the offline estimate's sequences

    # The n-gram baseline (a third server, same prompts): vLLM's counters, and the simulation over
    # that server's own outputs counting the same drafts and draft tokens, and the same accepted
    # tokens but for those past the end of a sequence (vLLM verified them, then cut the output).
    ng = r["ngram"]
    assert ng["measured"] and ng["server"]["ready_s"] > 0 and set(ng["speedup"]) == {"1", "3"}
    for nw in ng["windows"]:
        s = nw["ngram"]
        before, after = s["counters"]["before"], s["counters"]["after"]
        assert after["generation_tokens"] - before["generation_tokens"] == s["output_tokens"] > 0
        drafts, acc = after["drafts"] - before["drafts"], after["accepted"] - before["accepted"]
        assert drafts <= after["draft_tokens"] - before["draft_tokens"] <= kn * drafts
        assert (
            sum(
                after["accepted_per_pos"].get(str(i), 0) - before["accepted_per_pos"].get(str(i), 0)
                for i in range(kn)
            )
            == acc
        )
        assert (
            nw["outputs"]["mismatches"] == 0
        )  # float32 greedy: n-gram speculation changes nothing either
        sv = nw["simulated_vs_vllm"]
        print(f"n-gram c={nw['concurrency']}: " + ", ".join(f"{n} {sv[n]}" for n in sv))
        assert [sv[n]["simulated"] for n in ("drafts", "draft_tokens")] == [
            sv[n]["vllm"] for n in ("drafts", "draft_tokens")
        ], sv
        a = sv[
            "accepted"
        ]  # vLLM may have accepted proposed tokens past max_tokens before cutting the output
        assert a["simulated"] <= a["vllm"] <= a["simulated"] + a["unchecked_at_ends"], sv
    assert len((out / "outputs" / "ngram-c1.jsonl").read_text().splitlines()) == 5
    vs = r["versus_ngram"]  # the gate's verdict is the comparison of these numbers
    d, n = vs["draft"], vs["ngram"]
    beats = d["acceptance_length"] > n["acceptance_length"] and d["speedup"] > n["speedup"]
    assert vs["concurrency"] == 1 and r["gate"]["checks"]["beats_ngram"] is beats, vs
    print(
        f"n-gram: acceptance length {ng['acceptance_length']} (vLLM, proposing steps), "
        f"{ng['acceptance_length_all_steps']:.3f} over all steps; speedup {ng['speedup']}; ready in "
        f"{ng['server']['ready_s']} s"
    )
    assert "## N-gram baseline (prompt lookup) vs the draft" in (out / "report.md").read_text()
    assert r["gate"]["passed"] and r["promoted"]
    assert os.path.realpath(tmp_path / "promoted" / "smollm2-cpu" / "latest") == os.path.realpath(
        r["promoted"]
    )

    # The promoted draft carries what to serve: the config vLLM served the draft with at its best
    # k (its server's own command line), pointing at the promoted copy of the same files. (No
    # server of its own: one start less in CI's time; test_flow serves a hero run's draft.)
    serving = json.loads((Path(r["promoted"]) / "serving.json").read_text())
    rec = serving["recommended"]
    assert rec["concurrency"] == 1 and rec["num_speculative_tokens"] == k
    assert rec["speculative_config"] == {
        "method": "eagle3",
        "model": r["promoted"],
        "num_speculative_tokens": k,
    }
    assert rec["vllm_args"] == ["--speculative-config", json.dumps(rec["speculative_config"])]
    served = json.loads(spec_log.split("--speculative-config", 1)[1].split()[0].strip("'"))
    assert {**served, "model": r["promoted"]} == rec["speculative_config"], served
    files = sorted(p.name for p in Path(served["model"]).iterdir())
    assert files and all(
        (Path(served["model"]) / f).read_bytes() == (Path(r["promoted"]) / f).read_bytes()
        for f in files
    ), files
    assert set(serving["by_concurrency"]) == {"1", "3"}
    assert rec["ngram"]["num_speculative_tokens"] == kn
    for c, e in serving["by_concurrency"].items():  # each concurrency's best measured k
        assert e["speculative_config"]["num_speculative_tokens"] == best["draft", c], (c, e)
        assert e["ngram"]["num_speculative_tokens"] == best["ngram", c], (c, e)
    # the session's target server, asked for only now: not held through the sweep's servers
    vllm_server = request.getfixturevalue("vllm_server")
    _refuse_a_worse_draft(vllm_server, smol_model, trained_draft, tmp_path, r["promoted"])


def _refuse_a_worse_draft(
    vllm_server, smol_model: Path, draft: Path, runs_dir: Path, promoted: str
) -> None:
    """The gate end to end: with ``promoted`` the profile's last promoted draft, a worse draft
    (the same with its lm_head negated: it proposes the tokens it finds least likely) verified on
    the same workload is refused as a regression, GateFailed saying why; the promoted draft, its
    record and its serving.json stay the first's.

    One server start: the worse draft's (bf16, like the session's target server, the baseline
    here through serve.backend external); the promoted draft is compared by its record."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from eagle3.serving.server import start_server
    from eagle3.serving.units import speculative_config
    from eagle3.verify import verify
    from eagle3.verify.gate import promoted_dir
    from tests.conftest import gen_cfg

    root = promoted_dir(runs_dir, "smollm2-cpu")
    kept = {p: p.read_bytes() for p in (root / "latest.json", root / "history.jsonl")}
    kept[Path(promoted) / "serving.json"] = (Path(promoted) / "serving.json").read_bytes()
    prev = last_promoted(runs_dir, "smollm2-cpu")
    k = prev["num_speculative_tokens"]  # compared at the promoted draft's own k
    al = prev["acceptance_by_k"][str(k)]
    # the 2-epoch test draft accepts ~3% of its first proposals (acceptance length ~1.03), so the
    # default 5% window reaches below 1, where no draft can fall: half the room above 1 instead
    assert al > 1, prev
    max_regression = (1 - 1 / al) / 2
    worse = runs_dir / "worse-draft"
    shutil.copytree(draft, worse)
    st = worse / "model.safetensors"
    with safe_open(st, "pt") as f:
        meta = f.metadata()
    weights = load_file(st)
    weights["lm_head.weight"] = -weights["lm_head.weight"]
    save_file(weights, st, metadata=meta)

    server_cfg = gen_cfg(runs_dir, "serve.port=0")
    spec = speculative_config(server_cfg, str(worse), k)
    out = runs_dir / "verify-worse"
    with start_server(
        server_cfg, str(smol_model), speculative_config=spec, log_dir=runs_dir / "worse-logs"
    ) as server:
        cfg = gen_cfg(
            runs_dir,
            f"verify.workload={PROMPTS}",  # the first run's workload, max_tokens and temperature
            "verify.max_tokens=32",
            "verify.concurrency=[1]",
            "verify.warmup_requests=0",
            "verify.offline_estimate=false",
            "verify.ngram_baseline=false",
            "verify.min_acceptance_length=1.0",
            f"verify.max_regression={max_regression}",
            f"verify.num_speculative_tokens={k}",
            "serve.backend=external",
            f"serve.base_url={vllm_server.base_url}",
            f"verify.speculative_base_url={server.base_url}",
        )
        with pytest.raises(GateFailed) as failed:
            verify(cfg, str(smol_model), worse, out)
    r = json.loads((out / "report.json").read_text())
    now = r["acceptance_length"]  # drafts were counted (not None), and fewer were accepted
    assert now is not None and now < al * (1 - max_regression), r["acceptance"]
    reason = (
        f"acceptance length {now:.3f} at k={k} is more than {max_regression:.0%} below the last "
        f"promoted draft's {al:.3f} at k={k} ({promoted})"
    )
    assert r["gate"]["reasons"] == [reason] and not r["gate"]["passed"]  # that reason alone
    assert r["gate"]["checks"]["previous"]["draft"] == promoted
    assert str(failed.value) == (
        f"verify gate failed for {worse.resolve()}: {reason} (report: {out / 'report.md'}); "
        "the draft was not promoted"
    )
    md = (out / "report.md").read_text()
    assert f"- gate: **FAILED**: {reason}" in md and "- promoted: no" in md
    assert r["promoted"] is None and {p: p.read_bytes() for p in kept} == kept
    assert os.path.realpath(root / "latest") == os.path.realpath(promoted)
    assert [p.name for p in (root / "drafts").iterdir()] == [Path(promoted).name]


@pytest.mark.vllm
def test_verify_gate_fails_without_speculation(vllm_server, smol_model, trained_draft, tmp_path):
    """External backend with a 'speculative' server that has no draft: no drafts counted, the gate
    fails with a clear message, nothing is promoted, and the report is still written."""
    from eagle3.verify import verify
    from tests.conftest import gen_cfg

    cfg = gen_cfg(
        tmp_path,
        f"verify.workload={PROMPTS}",
        "verify.num_prompts=1",
        "verify.turns=1",
        "verify.max_tokens=8",
        "verify.concurrency=[1]",
        "verify.offline_estimate=false",
        "serve.backend=external",
        f"serve.base_url={vllm_server.base_url}",
        f"verify.speculative_base_url={vllm_server.base_url}",
        "verify.num_speculative_tokens=3",  # one k: an external server serves one
    )
    with pytest.raises(GateFailed, match="no speculative drafts were counted.*not promoted"):
        verify(cfg, str(smol_model), trained_draft, tmp_path / "verify")
    r = json.loads((tmp_path / "verify" / "report.json").read_text())
    assert not r["gate"]["passed"] and r["promoted"] is None and r["outputs"]["mismatches"] == 0
    assert last_promoted(tmp_path, "smollm2-cpu") is None
    # a k sweep starts a server per k: an external server is refused before anything runs
    ks = cfg.verify.model_copy(update={"num_speculative_tokens": [1, 3]})
    sweep = cfg.model_copy(update={"verify": ks})
    with pytest.raises(ValueError, match="a k sweep starts a server per k.*set one k"):
        verify(sweep, str(smol_model), trained_draft, tmp_path / "verify-sweep")


def test_candidate_link_points_at_the_draft_under_test(tmp_path):
    """systemd backend: the speculative unit serves a fixed path; verify swaps the symlink."""
    from eagle3.config import load_config
    from eagle3.verify.runner import point_candidate
    from tests.conftest import KIMI_PROFILE

    a, b = tmp_path / "draft-a", tmp_path / "draft-b"
    a.mkdir(), b.mkdir()
    link = tmp_path / "var" / "candidate-draft"
    point_candidate(link, a)
    assert link.resolve() == a.resolve()
    point_candidate(link, b)
    assert link.resolve() == b.resolve() and not list(link.parent.glob(".*tmp"))
    cfg = load_config(KIMI_PROFILE)
    assert (
        cfg.verify.speculative_unit
        and cfg.verify.candidate_link
        and not cfg.verify.offline_estimate
    )
