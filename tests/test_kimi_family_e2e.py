"""The Kimi architecture family end to end on CPU: the tiny random DeepSeek-V3 profile
(configs/tiny-deepseek-cpu.yaml) through the whole hero run, for real.

serve (vLLM CPU, MLA + MoE target) -> generate -> extract (vLLM backend with the project's
connector: Kimi's production path) -> vocab -> train (MLA draft) -> verify (baseline, then target +
the exported Eagle3DeepseekV2ForCausalLM draft with speculative decoding). Acceptance on a random
target is no quality figure; what is checked is that every stage ran and that the verify report
reads real spec-decode counters. The HF extract backend then runs on the same generated data and
must agree with the vLLM states (tolerances as in tests/test_tiny_deepseek_vllm.py).

Four vLLM server starts (generate, extract, verify x 2): the most expensive test of the suite,
kept small (4 prompts x 24 tokens, 2 epochs, 2 verify conversations x 1 turn x 24 tokens).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, require_vllm

pytestmark = pytest.mark.vllm

PROFILE = ROOT / "configs" / "tiny-deepseek-cpu.yaml"


def test_tiny_deepseek_hero_run(prefect_backend, smol_model, tmp_path):
    from eagle3.config import load_config
    from eagle3.extract.runner import extract
    from eagle3.extract.storage import HiddenStateDataset
    from flows.hero_run import HeroRunParams, hero_run

    overrides = [
        f"paths.runs_dir={tmp_path}",
        "generate.num_samples=4",
        "generate.max_tokens=24",
        "train.epochs=2",
        "verify.num_prompts=2",
        "verify.turns=1",
        "verify.max_tokens=24",
        "verify.concurrency=[1]",
        "verify.warmup_requests=0",
        "verify.ngram_baseline=false",
    ]  # the n-gram server is tested in test_verify: one start less here
    cfg = load_config(PROFILE, overrides)
    require_vllm(cfg)
    assert cfg.draft_arch == "mla" and cfg.extract.backend == "vllm"
    summary = hero_run(HeroRunParams(profile=str(PROFILE), overrides=overrides))
    stages = summary["stages"]
    assert all(
        stages[s]["status"] == "ran" for s in ("generate", "extract", "vocab", "train", "verify")
    ), stages
    assert summary["server"]["started_here"] and summary["server"]["backend"] == "process"

    draft = Path(stages["train"]["dir"]) / "vllm-draft"
    conf = json.loads((draft / "config.json").read_text())
    assert (
        conf["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]
        and conf["model_type"] == "deepseek_v2"
    )
    assert conf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]

    report = json.loads((Path(stages["verify"]["dir"]) / "report.json").read_text())
    w = report["windows"][0]["speculative"]
    b, a = w["counters"]["before"], w["counters"]["after"]
    assert a["drafts"] - b["drafts"] > 0 and a["draft_tokens"] - b["draft_tokens"] == 3 * (
        a["drafts"] - b["drafts"]
    )
    assert report["acceptance_length"] == pytest.approx(
        1 + (a["accepted"] - b["accepted"]) / (a["drafts"] - b["drafts"])
    )
    assert report["draft_dir"] == str(draft.resolve())
    print(
        f"\ntiny DeepSeek-V3 hero run: {summary['wall_s']} s; verify acceptance length {report['acceptance_length']:.3f}, "
        f"offline {report['offline'] and report['offline']['acceptance_length']}, greedy mismatches "
        f"{report['outputs']['mismatches']}/{report['outputs']['compared']}"
    )

    # The HF backend on the same generated data: same samples, states close to vLLM's.
    gen_dir, vllm_dir = Path(stages["generate"]["dir"]), Path(stages["extract"]["dir"])
    hf_cfg = load_config(PROFILE, [*overrides, "extract.backend=hf"])
    extract(hf_cfg, gen_dir, tmp_path / "extract-hf", summary["model"])
    hf, vl = HiddenStateDataset(tmp_path / "extract-hf"), HiddenStateDataset(vllm_dir)
    assert len(hf) == len(vl) == 4
    by_id = {vl[i].id: vl[i] for i in range(len(vl))}
    for i in range(len(hf)):
        x = hf[i]
        y = by_id[x.id]
        assert torch.equal(x.input_ids, y.input_ids)
        for name, bound in (("aux", 4e-2), ("final", 6e-2)):
            p, q = getattr(x, name).float(), getattr(y, name).float()
            rel = float((p - q).norm() / q.norm())
            assert rel < bound, f"{x.id} {name}: HF vs vLLM relative error {rel:.3g}"
