"""A tiny parallel-drafting draft (train.parallel_depths) with two decoder layers
(train.draft_num_layers, as P-EAGLE recipes have several) trained by the train stage, served by a
REAL vLLM CPU server with ``parallel_drafting: true``: vLLM loads its ptd_token_id, mask_hidden
and second layer, drafts k tokens a step in one pass, and counts per position what the offline
estimate of parallel chains predicts on the same greedy outputs. One server (CI's time); the
choice between sequential and parallel drafting is tests/test_verify_sweep.py's; one-layer drafts
are served in tests/test_verify.py and tests/test_draft_model.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import gen_cfg, require_vllm

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
        "train.epochs=30",
        "train.ttt_steps=1",  # P-EAGLE alone: the pass it is served with (and a cheaper step)
        "train.lr=3e-3",
        "train.token_budget=512",
        f"train.parallel_depths={K}",
        "train.draft_num_layers=2",
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
    assert conf["num_hidden_layers"] == 2
    metrics = json.loads((tmp_path / "train" / "metrics.json").read_text())["epochs"][-1]
    assert metrics["columns"][-2:] == ["parallel 1", "parallel 2"]

    # served: the prompts it was trained on (it has learned their answers, so every position
    # accepts something, and a layer vLLM got wrong would show in the counts)
    work = tmp_path / "trained-prompts.jsonl"
    work.write_text(
        "".join(
            json.dumps({"id": r["id"], "prompt": r["messages"][0]["content"]}) + "\n"
            for r in map(json.loads, (gen_dir / "samples-00000.jsonl").open())
        )
    )
    convs = load_workload(str(work), 8, 1)
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
    # the second layer counts: the same export with it left out (what serving one layer of it
    # would count) is estimated apart from vLLM's counts
    one = _first_layer_only(draft, tmp_path / "one-layer")
    alone = offline_acceptance(smol_model, one, seqs, K, ngram_lookup=None, parallel=True)
    print(f"layer 0 alone: offline {alone['acceptance_per_position']}")
    assert max(abs(alone["acceptance_per_position"][i] - vllm_pos[i]) for i in range(K)) > 0.1
    assert vllm_pos[1] > 0.1  # a parallel slot is accepted: the depths were served, not only slot 0


def _first_layer_only(draft: Path, out: Path) -> Path:
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    out.mkdir()
    conf = json.loads((draft / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**conf, "num_hidden_layers": 1}))
    with safe_open(draft / "model.safetensors", "pt") as f:
        meta = f.metadata()
    w = load_file(draft / "model.safetensors")
    save_file(
        {k: v for k, v in w.items() if not k.startswith("layers.1.")},
        out / "model.safetensors",
        metadata=meta,
    )
    return out
