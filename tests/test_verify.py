"""Verify stage: counters, workload, gate, offline estimate; and the real thing on vLLM CPU
(baseline server, then target + the pipeline's own trained draft with speculative decoding)."""

from __future__ import annotations

import json
import math
import os
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
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="1"} 1\n')
    d = (after - before).summary()
    assert d["acceptance_length"] == pytest.approx(1 + 9 / 6)
    assert d["acceptance_rate"] == pytest.approx(9 / 18)
    assert d["acceptance_per_position"] == pytest.approx([5 / 6, 3 / 6, 1 / 6])
    full = after.summary()
    assert full["acceptance_length"] == pytest.approx(2.2) and full["acceptance_per_position"] == [0.7, 0.4, 0.1]
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
    cond = {"workload_fingerprint": "w", "num_speculative_tokens": 3, "temperature": 0.0, "max_tokens": 64}
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
    accepted = chains_of_sequence(OracleDraft(seq, 17, right), torch.zeros(40, 3), seq, 9, k, torch.arange(17))
    s = summarize_chains(accepted, k)
    # every chain but possibly the last (cut at the end of the sequence) accepts min(right, k)
    assert all(a == min(right, k) for a in accepted[:-1])
    assert s["acceptance_length"] == pytest.approx(expect, abs=0.5)
    assert sum(a + 1 for a in accepted) <= 40 - 9


@pytest.mark.vllm
def test_verify_on_vllm(trained_draft, smol_model, tmp_path):
    """Baseline, then target + the trained draft: the report's numbers are the raw counters' numbers."""
    from eagle3.verify import verify
    from tests.conftest import gen_cfg

    # float32 servers: speculative decoding must then leave greedy output exactly unchanged (in bf16
    # the 4-token verification GEMMs round differently from 1-token decode steps, and near-tied
    # logits flip: docs/verify.md)
    cfg = gen_cfg(tmp_path, f"verify.workload={PROMPTS}", "verify.max_tokens=32", "verify.concurrency=[1, 3]",
                  "verify.warmup_requests=1", "serve.port=0", "serve.dtype=float32",
                  "verify.min_acceptance_length=1.0")  # a 2-epoch draft on 8 samples: barely above 1
    r = verify(cfg, str(smol_model), trained_draft, tmp_path / "verify")
    out = tmp_path / "verify"
    assert json.loads((out / "report.json").read_text()) == json.loads(json.dumps(r))
    assert (out / "report.png").stat().st_size > 0 and "mean acceptance length" in (out / "report.md").read_text()

    k = 3
    total_drafts = total_acc = 0.0
    for w in r["windows"]:
        for side in ("baseline", "speculative"):
            s = w[side]
            before, after = s["counters"]["before"], s["counters"]["after"]
            # the server generated exactly the tokens the client received
            assert after["generation_tokens"] - before["generation_tokens"] == s["output_tokens"] > 0
            assert s["requests"] == 5
        s = w["speculative"]
        b, a = s["counters"]["before"], s["counters"]["after"]
        drafts, acc = a["drafts"] - b["drafts"], a["accepted"] - b["accepted"]
        assert drafts > 0 and a["draft_tokens"] - b["draft_tokens"] == k * drafts
        assert s["acceptance_length"] == pytest.approx(1 + acc / drafts)
        assert s["acceptance_rate"] == pytest.approx(acc / (a["draft_tokens"] - b["draft_tokens"]))
        per = [a["accepted_per_pos"][str(i)] - b["accepted_per_pos"].get(str(i), 0) for i in range(k)]
        assert s["acceptance_per_position"] == pytest.approx([p / drafts for p in per])
        assert sum(per) == acc
        assert w["speedup"] == pytest.approx(s["output_tokens_per_s"] / w["baseline"]["output_tokens_per_s"])
        assert w["baseline"]["counters"]["after"]["drafts"] == 0  # the baseline has no draft
        total_drafts, total_acc = total_drafts + drafts, total_acc + acc
    assert r["acceptance_length"] == pytest.approx(1 + total_acc / total_drafts)
    assert 1 < r["acceptance_length"] <= 1 + k
    assert r["outputs"]["compared"] == 10 and r["outputs"]["mismatches"] == 0, r["windows"]
    assert r["windows"][1]["baseline_vs_first_window"]["mismatches"] == 0
    assert len((out / "outputs" / "speculative-c3.jsonl").read_text().splitlines()) == 5
    # How vLLM loaded the export (its own log lines): the embedding is not in the export, so vLLM
    # shares the target's and keeps our lm_head; the auxiliary layer ids reached the target.
    spec_log = next(p.read_text() for p in sorted((out / "logs").glob("*.log")) if "--speculative-config" in p.read_text())
    assert "without its own embed_tokens" in spec_log and "distinct lm_head" in spec_log, spec_log[-3000:]
    assert "(2, 15, 27)" in spec_log
    print(f"\nverify: acceptance length {r['acceptance_length']:.3f}, per position "
          f"{[round(x, 3) for x in r['acceptance']['acceptance_per_position']]}, speedup {r['speedup']}, "
          f"greedy mismatches {r['outputs']['mismatches']}/{r['outputs']['compared']}, offline "
          f"{r['offline']['acceptance_length']:.3f} (diff {r['offline']['difference_from_vllm']:+.3f})")
    assert r["offline"]["chains"] > 0 and math.isfinite(r["offline"]["difference_from_vllm"])
    assert r["gate"]["passed"] and r["promoted"]
    assert os.path.realpath(tmp_path / "promoted" / "smollm2-cpu" / "latest") == os.path.realpath(r["promoted"])


@pytest.mark.vllm
def test_verify_gate_fails_without_speculation(vllm_server, smol_model, trained_draft, tmp_path):
    """External backend with a 'speculative' server that has no draft: no drafts counted, the gate
    fails with a clear message, nothing is promoted, and the report is still written."""
    from eagle3.verify import verify
    from tests.conftest import gen_cfg

    cfg = gen_cfg(tmp_path, f"verify.workload={PROMPTS}", "verify.num_prompts=1", "verify.turns=1",
                  "verify.max_tokens=8", "verify.concurrency=[1]", "verify.offline_estimate=false",
                  "serve.backend=external", f"serve.base_url={vllm_server.base_url}",
                  f"verify.speculative_base_url={vllm_server.base_url}")
    with pytest.raises(GateFailed, match="no speculative drafts were counted.*not promoted"):
        verify(cfg, str(smol_model), trained_draft, tmp_path / "verify")
    r = json.loads((tmp_path / "verify" / "report.json").read_text())
    assert not r["gate"]["passed"] and r["promoted"] is None and r["outputs"]["mismatches"] == 0
    assert last_promoted(tmp_path, "smollm2-cpu") is None


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
    assert cfg.verify.speculative_unit and cfg.verify.candidate_link and not cfg.verify.offline_estimate
