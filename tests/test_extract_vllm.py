"""The vLLM extract backend against transformers, on the real vLLM CPU server.

vLLM serves SmolLM2 in bfloat16 (configs/smollm2-cpu.yaml); the reference is transformers in
float32. The tolerances come from the same comparison made inside transformers (HF bf16 vs HF
fp32 on three short prompts, on this machine): relative error 0.2-1.1 % at the auxiliary layers
and 2.1-3.2 % at the final pre-norm state (30 layers of bf16 rounding accumulate; the middle
layers look better because a few huge "massive activation" channels dominate the norm). vLLM
measured 0.1-0.7 % and 0.9-2.8 % on those prompts, 0.26-0.44 % and 2.2 % on the prompts below.
Bounds: 2e-2 for the auxiliary layers, 5e-2 for the final state; a wrong token or a shifted
position gives errors of order 1, and the neighbour check below catches a shifted layer.
"""

from __future__ import annotations

import time

import pytest
import torch

from tests.conftest import require_vllm

pytestmark = pytest.mark.vllm

N_LAYERS = 30
# Unsorted on purpose: vLLM stores the layers in ascending order, extract_vllm must reorder.
LAYER_IDS = [27, 2, 15, N_LAYERS]  # N_LAYERS = the last layer's output before the final norm
TOLERANCE = {2: 2e-2, 15: 2e-2, 27: 2e-2, N_LAYERS: 5e-2}

PROMPTS = [
    "What is the capital of France, and why did it become the capital?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain in two sentences why the sky is blue during the day and red at sunset.",
]


def hf_reference(model_path, token_lists: list[list[int]]) -> list[dict[int, torch.Tensor]]:
    """transformers fp32: hidden_states[k] for aux layers; the final norm's INPUT for layer N
    (HF's hidden_states[N] is after the final norm)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    captured: dict[str, torch.Tensor] = {}
    model.model.norm.register_forward_pre_hook(lambda _m, args: captured.__setitem__("final", args[0]))
    refs = []
    for ids in token_lists:
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_hidden_states=True)
        ref = {k: out.hidden_states[k][0] for k in range(N_LAYERS)}  # [N] (post-norm) left out
        ref[N_LAYERS] = captured["final"][0]
        refs.append(ref)
    return refs


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_extract_vllm_matches_transformers(cpu_cfg, smol_model, tmp_path):
    from transformers import AutoTokenizer

    from eagle3.extract.vllm_backend import extract_vllm

    require_vllm(cpu_cfg)
    tok = AutoTokenizer.from_pretrained(smol_model)
    samples = {
        f"s{i}": tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True,
                                         return_dict=True)["input_ids"]
        for i, p in enumerate(PROMPTS)
    }
    assert all(20 <= len(ids) <= 80 for ids in samples.values()), {k: len(v) for k, v in samples.items()}

    t0 = time.monotonic()
    got = {}
    for sample_id, hidden in extract_vllm(cpu_cfg, str(smol_model), samples.items(), LAYER_IDS, tmp_path):
        got[sample_id] = hidden
    elapsed = time.monotonic() - t0
    assert set(got) == set(samples)
    assert not list((tmp_path / "vllm-hidden").iterdir()), "per-request files must be deleted once read"

    refs = hf_reference(smol_model, list(samples.values()))
    print(f"\nextract_vllm: {len(samples)} samples in {elapsed:.1f} s (server start included)")
    print(f"{'sample':>6} {'layer':>5} {'tokens':>6} {'max abs':>9} {'rel':>8} {'rel vs k+-1':>11}")
    for (sample_id, ids), ref in zip(samples.items(), refs):
        hidden = got[sample_id]
        assert hidden.shape == (len(ids), len(LAYER_IDS), 576) and hidden.dtype == torch.float32
        for j, k in enumerate(LAYER_IDS):
            a, b = hidden[:, j], ref[k]
            err = rel(a, b)
            # Convention check (catches an off-by-one): HF layer k is the closest of k-1, k, k+1. Not
            # a margin: the residual stream's few huge channels change little from layer to layer.
            neighbour = min(rel(a, ref[n]) for n in (k - 1, k + 1) if n in ref)
            max_abs = float((a - b).abs().max())
            print(f"{sample_id:>6} {k:>5} {len(ids):>6} {max_abs:>9.3g} {err:>8.2e} {neighbour:>11.2e}")
            assert err < TOLERANCE[k], (sample_id, k, err)
            assert err < neighbour, (sample_id, k, err, neighbour)
