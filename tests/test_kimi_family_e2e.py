"""The Kimi architecture family end to end on CPU: the tiny random DeepSeek-V3 profile
(configs/tiny-deepseek-cpu.yaml) through the whole hero run, for real.

serve (vLLM CPU, MLA + MoE target) -> generate -> extract (vLLM backend with the project's
connector: Kimi's production path) -> vocab -> train (MLA draft) -> verify (baseline, then target +
the exported Eagle3DeepseekV2ForCausalLM draft with speculative decoding). Acceptance on a random
target is no quality figure; what is checked is that every stage ran and that the verify report
reads real spec-decode counters. The prompts are tests/test_tiny_deepseek_vllm.py's three (plus one):
over their prompt tokens the vLLM extract backend's states are checked layer by layer against
transformers float32 with that file's tolerances and neighbour check (the answers of a random
target may flip a token's expert choice under bf16 at layer 2: those bounds hold for these
prompts). The HF extract backend then runs on the same generated data and must agree with the
vLLM states on every token.

Four vLLM server starts (generate, extract, verify x 2): the most expensive test of the suite,
kept small (4 prompts x 24 tokens, 2 epochs, 2 verify conversations x 1 turn x 24 tokens). The
extract server is the only vLLM extract of the tiny DeepSeek-V3 in the suite: the transformers
comparison rides on it rather than starting a server of its own.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, require_vllm
from tests.test_tiny_deepseek_vllm import N_LAYERS, PROMPTS, TOLERANCE, hf_reference, rel

pytestmark = pytest.mark.vllm

PROFILE = ROOT / "configs" / "tiny-deepseek-cpu.yaml"


def test_tiny_deepseek_hero_run(prefect_backend, smol_model, tmp_path):
    from eagle3.config import load_config
    from eagle3.extract.runner import extract
    from eagle3.extract.storage import HiddenStateDataset
    from flows.hero_run import HeroRunParams, hero_run

    data = tmp_path / "prompts.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": p}) + "\n" for p in [*PROMPTS, "Name three primary colors."])
    )
    overrides = [
        f"paths.runs_dir={tmp_path}",
        f"generate.dataset={data}",
        "generate.num_samples=null",
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

    gen_dir, vllm_dir = Path(stages["generate"]["dir"]), Path(stages["extract"]["dir"])
    check_vllm_states_against_transformers(vllm_dir, gen_dir, summary["model"])

    # The HF backend on the same generated data: same samples, states close to vLLM's.
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


def check_vllm_states_against_transformers(vllm_dir: Path, gen_dir: Path, model: str) -> None:
    """The extract stage's vLLM states (aux layers 1, 3, 4 and the final norm's input) over the
    prompt tokens of the ``PROMPTS`` samples against transformers float32 on those tokens, per
    layer within tests/test_tiny_deepseek_vllm.py's bounds, each closer to its own layer than to
    the neighbours (a shifted layer fails); per-request files deleted."""
    from eagle3.extract.storage import HiddenStateDataset
    from eagle3.generate.storage import iter_samples

    assert not list((vllm_dir / "vllm-work" / "vllm-hidden").iterdir()), (
        "per-request files are deleted"
    )
    prompt_ids = {
        s["id"]: s["prompt_token_ids"]
        for s in iter_samples(gen_dir)
        if s["messages"][0]["content"] in PROMPTS
    }
    assert len(prompt_ids) == len(PROMPTS)
    ds = HiddenStateDataset(vllm_dir, torch.float32)
    samples = [ds[i] for i in range(len(ds)) if ds[i].id in prompt_ids]
    refs = hf_reference(model, [prompt_ids[x.id] for x in samples])
    print(f"{'sample':>8} {'layer':>5} {'tokens':>6} {'rel':>8} {'rel vs k+-1':>11}")
    for x, ref in zip(samples, refs):
        n = len(prompt_ids[x.id])
        assert x.input_ids[:n].tolist() == prompt_ids[x.id]
        states = {k: x.aux[:n, j * 256 : (j + 1) * 256] for j, k in enumerate([1, 3, 4])}
        for k, a in (states | {N_LAYERS: x.final[:n]}).items():
            err = rel(a, ref[k])
            neighbour = min(rel(a, ref[m]) for m in (k - 1, k + 1) if m in ref)
            print(f"{x.id[:8]:>8} {k:>5} {n:>6} {err:>8.2e} {neighbour:>11.2e}")
            assert err < TOLERANCE[k], (x.id, k, err)
            assert err < neighbour, (x.id, k, err, neighbour)
