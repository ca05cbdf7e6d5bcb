"""A tiny parallel-drafting draft (train.parallel_depths) trained by the train stage, served by a
REAL vLLM CPU server with ``parallel_drafting: true``: vLLM loads its ptd_token_id and
mask_hidden, drafts k tokens a step in one pass, and counts per position what the offline
estimate of parallel chains predicts on the same greedy outputs. One server (CI's time); the
choice between sequential and parallel drafting is tests/test_verify_sweep.py's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import gen_cfg, require_vllm

PROMPTS = Path(__file__).parent / "data" / "verify-prompts.jsonl"
K = 3


def test_parallel_draft_trains_exports_and_is_served(gen_dir, smol_model, tmp_path):
    from eagle3.extract.runner import extract
    from eagle3.serving.server import start_server
    from eagle3.serving.units import speculative_config
    from eagle3.train import train
    from eagle3.verify.arms import measure, per_position
    from eagle3.verify.offline import offline_acceptance
    from eagle3.verify.workload import load_workload
    from eagle3.vocab import vocab_stage

    cfg = gen_cfg(
        tmp_path,
        "train.epochs=3",
        "train.lr=1e-3",
        "train.token_budget=512",
        f"train.parallel_depths={K}",
        "serve.port=0",
        "serve.dtype=float32",  # greedy outputs unchanged by speculation: the estimate's input
        "verify.max_tokens=32",
        "verify.concurrency=[1]",
        "verify.warmup_requests=1",
    )
    require_vllm(cfg)
    extract(cfg, gen_dir, tmp_path / "extract", str(smol_model))
    vocab_stage(tmp_path / "extract", tmp_path / "vocab", 49152, 512)
    m = train(
        cfg, tmp_path / "extract", tmp_path / "vocab" / "vocab.safetensors", smol_model,
        tmp_path / "train",
    )  # fmt: skip
    draft = Path(m["export"])
    conf = json.loads((draft / "config.json").read_text())
    # SmolLM2's pad token (<|im_end|>, id 2) is the placeholder; trained for K tokens a pass
    assert conf["ptd_token_id"] == 2 and conf["parallel_drafting_depths"] == K
    metrics = json.loads((tmp_path / "train" / "metrics.json").read_text())["epochs"][-1]
    assert metrics["columns"][-2:] == ["parallel 1", "parallel 2"]

    convs = load_workload(str(PROMPTS), cfg.verify.num_prompts, cfg.verify.turns)
    spec = speculative_config(cfg, str(draft), K, parallel=True)
    assert spec["parallel_drafting"] is True
    with start_server(
        cfg, str(smol_model), speculative_config=spec, log_dir=tmp_path / "logs"
    ) as srv:
        windows = measure(srv, convs, cfg, "parallel")
    run, before, after = windows[0]
    counted = after - before
    drafts = counted.drafts
    assert drafts > 0 and counted.draft_tokens == K * drafts  # K draft tokens every step
    vllm_pos = per_position(windows)
    seqs = [(r.prompt_token_ids, r.token_ids) for r in run.results]
    est = offline_acceptance(smol_model, draft, seqs, K, ngram_lookup=None, parallel=True)
    print(f"vLLM per position {vllm_pos}, offline {est['acceptance_per_position']}")
    # the same chains on the same outputs: vLLM's fp32 kernels against PyTorch's can differ only
    # where two logits nearly tie
    for i in range(K):
        assert est["acceptance_per_position"][i] == pytest.approx(vllm_pos[i], abs=0.05)
    assert est["acceptance_length"] == pytest.approx(1 + sum(vllm_pos.values()), abs=0.08)
