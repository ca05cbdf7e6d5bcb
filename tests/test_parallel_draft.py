"""Parallel drafting (P-EAGLE): the training unroll's parallel depths are exactly what vLLM feeds
the draft in one pass, the fast loss equals the reference, the offline estimate of a parallel
chain equals a walk that runs the draft as vLLM does, and the export carries what vLLM reads.
No server here (tests/test_verify.py serves a parallel draft on vLLM CPU)."""

from __future__ import annotations

import json

import pytest
import torch

from eagle3.draft import DraftConfig, Eagle3Draft
from eagle3.draft.export import export_speculators, export_vllm, load_exported
from eagle3.train.batch import Batch
from eagle3.train.ttt import TTTObjective, column_names, ttt_unroll
from eagle3.train.ttt_fast import fast_unroll
from eagle3.verify.ngram import leading_matches
from eagle3.verify.offline import chain_accepts, walk_chains
from tests.test_offline_estimate import small_draft

PTD = 5  # the placeholder token


def parallel_draft(depths: int = 4, seed: int = 0, vocab: int = 8, layers: int = 1) -> Eagle3Draft:
    return small_draft(
        seed, vocab_size=vocab, draft_vocab_size=vocab, parallel_depths=depths,
        parallel_token_id=PTD, num_layers=layers,
    )  # fmt: skip


#: one decoder layer, and three (P-EAGLE recipes use 2-4): every layer keeps its own KV prefix
LAYERS = pytest.mark.parametrize("layers", [1, 3], ids=["1-layer", "3-layers"])


@torch.no_grad()
def served_logits(draft: Eagle3Draft, aux: torch.Tensor, ids: torch.Tensor, p: int, d: int):
    """Logits of one vLLM parallel pass after the target emitted ids[p+1]: the context rows
    0..p (token ids[t+1], state fc(aux[t]), position t; the last is the bonus slot), then d
    placeholder slots at positions p+1..p+d, one causal forward. Row p+j predicts draft j+1."""
    emb_ctx = draft.embed_tokens(ids[1 : p + 2])[None]
    hid_ctx = draft.fc(aux[: p + 1])[None]
    emb_m, hid_m = draft.placeholder(1, d)
    out = draft(
        ids[None, : p + 1 + d],  # unused: inputs_embeds given
        torch.cat([hid_ctx, hid_m], 1),
        position_ids=torch.arange(p + 1 + d),
        inputs_embeds=torch.cat([emb_ctx, emb_m], 1),
    )
    return out[1][0]


def random_batch(draft: Eagle3Draft, length: int, seed: int) -> Batch:
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(1, length, draft.config.fc_input_size, generator=g)
    ids = torch.randint(0, draft.config.vocab_size, (1, length), generator=g)
    v = draft.config.draft_vocab_size
    probs = torch.softmax(torch.randn(1, length, v, generator=g), -1)
    ok = torch.rand(1, length, generator=g) < 0.8
    return Batch(input_ids=ids, aux=aux, probs=probs, target_arg=probs.argmax(-1), target_ok=ok)


@LAYERS
def test_parallel_depths_are_one_vllm_pass(layers):
    """Depth d at row p of the unroll (eager and fast) = slot d of vLLM's pass at p."""
    draft = parallel_draft(layers=layers)
    b = random_batch(draft, 12, 1)
    L = 12
    with torch.no_grad():
        eager = [(i, lg[0]) for i, _, lg in ttt_unroll(draft, b, 2, 4)]
        fast = list(fast_unroll(draft, b, 2, 4))
    assert [i for i, _ in eager] == [0, 1, 1, 2, 3] == [i for i, _ in fast]
    assert column_names(2, 4) == ["step 0", "step 1", "parallel 1", "parallel 2", "parallel 3"]
    par = {0: eager[0][1], 1: eager[2][1], 2: eager[3][1], 3: eager[4][1]}
    fast_par = {0: fast[0][1][0], 1: fast[2][1][0], 2: fast[3][1][0], 3: fast[4][1][0]}
    for p in range(L - 4):
        served = served_logits(draft, b.aux[0], b.input_ids[0], p, 3)
        for d in range(4):
            torch.testing.assert_close(par[d][p], served[p + d], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(fast_par[d][p], served[p + d], atol=1e-4, rtol=1e-4)


@LAYERS
def test_fast_parallel_loss_and_grads_equal_the_reference(layers):
    torch.manual_seed(0)
    grads = []
    for impl in ("eager", "fast"):
        draft = parallel_draft(layers=layers).train()
        b = random_batch(draft, 16, 2)
        obj = TTTObjective(draft, 2, 0.8, impl, parallel=4)
        loss, stats = obj(b)
        loss.backward()
        sums = stats if impl == "fast" else [[s["sum"] for s in stats]]
        col_sums = [float(x) for x in torch.as_tensor(sums)[0]]
        grads.append((float(loss.detach()), col_sums, draft.mask_hidden.grad.clone()))
    (l0, s0, g0), (l1, s1, g1) = grads
    assert l0 == pytest.approx(l1, rel=1e-5) and s0 == pytest.approx(s1, rel=1e-5)
    assert len(s0) == 5 and float(g0.abs().sum()) > 0  # mask_hidden is trained
    torch.testing.assert_close(g0, g1, atol=1e-5, rtol=1e-4)
    # the weights of the loss columns: decay ** chain position, the parallel depths too
    assert obj.offsets == [0, 1, 1, 2, 3]
    assert obj.weights(torch.device("cpu")).tolist() == pytest.approx([1, 0.8, 0.8, 0.64, 0.512])


@LAYERS
def test_parallel_estimate_equals_served_chains(layers):
    """chain_accepts(parallel=True) = the chains of vLLM's parallel passes, walked start to end."""
    draft = parallel_draft(depths=4, seed=3, vocab=6, layers=layers)
    g = torch.Generator().manual_seed(4)
    L, k = 40, 4
    aux = torch.randn(L, draft.config.fc_input_size, generator=g)
    ids = torch.randint(0, 6, (L,), generator=g)
    with torch.no_grad():  # make the sequence follow the draft's own pass at most rows
        for p in range(0, L - 2 - k):
            guess = served_logits(draft, aux, ids, p, k - 1).argmax(-1)[p:]
            if torch.rand((), generator=g) < 0.7:
                ids[p + 2 : p + 2 + k] = guess
    d2t = torch.arange(6)
    acc = chain_accepts(draft, aux[None], ids[None], torch.tensor([L]), k, d2t, parallel=True)
    start = 3
    got = walk_chains(acc[0].tolist(), start, L)
    want, p = [], start
    while p + 2 <= L - 1:
        guess = served_logits(draft, aux, ids, p, k - 1).argmax(-1)[p : p + k].tolist()
        a = leading_matches(guess, ids[p + 2 : p + 2 + k].tolist())
        want.append(a)
        p += a + 1
    assert got == want and max(want) >= 2  # chains longer than one token were checked


def test_export_carries_the_placeholder(tmp_path):
    draft = parallel_draft(depths=3)
    d2t = torch.zeros(8, dtype=torch.int64)
    t2d = torch.ones(8, dtype=torch.bool)
    out = export_vllm(draft, None, d2t, t2d, tmp_path / "v", dtype=torch.float32)
    conf = json.loads((out / "config.json").read_text())
    assert conf["ptd_token_id"] == PTD and conf["parallel_drafting_depths"] == 3
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert tuple(f.get_tensor("mask_hidden").shape) == (1, draft.config.fc_input_size)
    back, _, _ = load_exported(out)
    assert back.config == draft.config
    torch.testing.assert_close(back.mask_hidden, draft.mask_hidden)
    spec = export_speculators(
        draft, None, d2t, t2d, tmp_path / "s", verifier="t", dtype=torch.float32
    )
    sconf = json.loads((spec / "config.json").read_text())
    assert sconf["speculators_model_type"] == "peagle" and sconf["mask_token_id"] == PTD
    assert sconf["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    back, _, _ = load_exported(spec)
    assert back.config.parallel_token_id == PTD and back.config.parallel_depths == 3
    torch.testing.assert_close(back.mask_hidden, draft.mask_hidden)


def test_parallel_settings_are_checked(tmp_path):
    from eagle3.config import load_config
    from eagle3.train.build import draft_overrides

    with pytest.raises(ValueError, match="parallel_depths 1 is sequential"):
        load_config("configs/smollm2-cpu.yaml", ["train.parallel_depths=1"])
    kimi = load_config("configs/kimi-k25-hero.yaml", ["train.parallel_depths=4"])
    with pytest.raises(ValueError, match="no mask_hidden"):
        draft_overrides(kimi)
    smol = load_config("configs/smollm2-cpu.yaml", ["train.parallel_depths=4"])
    assert draft_overrides(smol)["parallel_depths"] == 4
    target = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4}
    target.update(vocab_size=8, num_hidden_layers=4)
    with pytest.raises(ValueError, match="no pad_token_id or eos_token_id"):
        DraftConfig.from_target(target, 8, [1, 2, 3], parallel_depths=4)
    cfg = DraftConfig.from_target(
        {**target, "eos_token_id": [7, 6]}, 8, [1, 2, 3], parallel_depths=4
    )
    assert cfg.parallel_token_id == 7  # no pad token: the first end-of-sequence token
    with pytest.raises(ValueError, match="needs parallel_token_id"):
        DraftConfig(**{**cfg.to_dict(), "parallel_token_id": None})
