"""The vLLM extract backend against transformers, on the real vLLM CPU server.

vLLM serves SmolLM2 in bfloat16 (configs/smollm2-cpu.yaml); the reference is transformers in
float32. The tolerances come from the same comparison made inside transformers (HF bf16 vs HF
fp32 on three short prompts, on this machine): relative error 0.2-1.1 % at the auxiliary layers
and 2.1-3.2 % at the final pre-norm state (30 layers of bf16 rounding accumulate; the middle
layers look better because a few huge "massive activation" channels dominate the norm). vLLM
measured 0.1-0.7 % and 0.9-2.8 % on those prompts, 0.26-0.44 % and 2.2 % on three chat prompts.
Bounds: 2e-2 for the auxiliary layers, 5e-2 for the final state; a wrong token or a shifted
position gives errors of order 1, and the neighbour check below catches a shifted layer.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.vllm

N_LAYERS = 30
TOLERANCE = {2: 2e-2, 15: 2e-2, 27: 2e-2, N_LAYERS: 5e-2}  # N_LAYERS: the final norm's input


def hf_reference(model_path, token_lists: list[list[int]]) -> list[dict[int, torch.Tensor]]:
    """transformers fp32: hidden_states[k] for aux layers; the final norm's INPUT for layer N
    (HF's hidden_states[N] is after the final norm)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    captured: dict[str, torch.Tensor] = {}
    model.model.norm.register_forward_pre_hook(
        lambda _m, args: captured.__setitem__("final", args[0])
    )
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


def test_vllm_backend_matches_transformers_and_the_hf_backend(
    smol_vllm_extract, gen_dir, smol_model, tmp_path
):
    """The extract stage with the vLLM backend (one server start, the session's
    ``smol_vllm_extract``, which tests/test_online.py trains on too) on the real generated data,
    against transformers fp32 layer by layer (with the neighbour check) and against the HF
    backend's output for the same samples. The auxiliary layers are given unsorted: vLLM returns
    them in ascending order and the backend must put them back in the configured order."""
    from eagle3.extract.runner import extract
    from eagle3.extract.storage import HiddenStateDataset
    from tests.conftest import SMOL_VLLM_AUX, gen_cfg

    aux = SMOL_VLLM_AUX
    assert aux != sorted(aux)
    vl, elapsed = smol_vllm_extract.manifest, smol_vllm_extract.elapsed_s
    hf = extract(
        gen_cfg(tmp_path, f"extract.aux_layers={aux}"), gen_dir, tmp_path / "hf", str(smol_model)
    )
    assert vl["samples"] == hf["samples"] == 8 and vl["backend"] == "vllm"
    assert not list((smol_vllm_extract.dir / "vllm-work" / "vllm-hidden").iterdir()), (
        "per-request files are deleted"
    )

    got = HiddenStateDataset(smol_vllm_extract.dir, torch.float32)
    hfb = HiddenStateDataset(tmp_path / "hf", torch.float32)
    assert got.ids == hfb.ids
    refs = hf_reference(smol_model, [got[i].input_ids.tolist() for i in range(len(got))])
    print(
        f"\nextract (vllm backend): {len(got)} samples in {elapsed:.1f} s (server start included)"
    )
    print(
        f"{'sample':>8} {'layer':>5} {'tokens':>6} {'rel':>8} {'rel vs k+-1':>11} {'vs HF backend':>13}"
    )
    for i, ref in enumerate(refs):
        x, y = got[i], hfb[i]
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.loss_mask, y.loss_mask)
        states = {k: x.aux[:, j * 576 : (j + 1) * 576] for j, k in enumerate(aux)} | {
            N_LAYERS: x.final
        }
        hf_states = {k: y.aux[:, j * 576 : (j + 1) * 576] for j, k in enumerate(aux)} | {
            N_LAYERS: y.final
        }
        for k, a in states.items():
            err = rel(a, ref[k])
            # Convention check (catches an off-by-one): HF layer k is the closest of k-1, k, k+1. Not
            # a margin: the residual stream's few huge channels change little from layer to layer.
            neighbour = min(rel(a, ref[n]) for n in (k - 1, k + 1) if n in ref)
            vs_backend = rel(a, hf_states[k])
            print(
                f"{x.id[:8]:>8} {k:>5} {len(x.input_ids):>6} {err:>8.2e} {neighbour:>11.2e} {vs_backend:>13.2e}"
            )
            assert err < TOLERANCE[k], (x.id, k, err)
            assert err < neighbour, (x.id, k, err, neighbour)
            assert vs_backend < TOLERANCE[k], (x.id, k, vs_backend)
