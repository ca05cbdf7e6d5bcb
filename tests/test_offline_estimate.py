"""The batched offline acceptance estimate (one forward per draft step for every chain start at
once) against the chain-by-chain walk that mirrors vLLM's proposer. No server, no target: a small
random draft and sequences built so that its guesses are often right (a tiny vocabulary, and
most tokens set to the draft's own step-0 guess), so that chains of every length occur."""

from __future__ import annotations

import pytest
import torch

from eagle3.draft import DraftConfig, Eagle3Draft
from eagle3.verify.offline import (
    chain_accepts,
    chains_of_sequence,
    spread,
    summarize_chains,
    walk_chains,
)


def small_draft(seed: int = 0, **fields) -> Eagle3Draft:
    """A 32-wide draft with decisive argmaxes; ``fields`` override its config."""
    base = dict(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=6,
        draft_vocab_size=6,
        target_hidden_size=16,
        aux_layer_ids=[1, 2, 3],
        rms_norm_eps=1e-5,
        max_position_embeddings=256,
    )
    cfg = DraftConfig(**{**base, **fields})
    torch.manual_seed(seed)
    d = Eagle3Draft(cfg)
    torch.nn.init.normal_(d.embed_tokens.weight)
    for (
        p
    ) in d.parameters():  # larger weights: decisive argmaxes, no near-ties between the two paths
        p.data.mul_(5.0) if p.dim() >= 2 else None
    return d.eval()


def sequence_following_draft(
    draft: Eagle3Draft, length: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """ids where x[t+2] is mostly the draft's step-0 guess at t (else random), aux random."""
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(length, draft.config.fc_input_size, generator=g)
    ids = torch.randint(0, draft.config.vocab_size, (length,), generator=g)
    with torch.no_grad():
        for t in range(length - 2):
            _, logits = draft(ids[1 : t + 2][None], aux[: t + 1][None])
            if torch.rand((), generator=g) < 0.8:
                ids[t + 2] = logits[0, t].argmax()
    return aux, ids


@pytest.mark.parametrize("layers", [1, 2])
def test_batched_estimate_equals_chain_walk(layers):
    """The one-forward-per-step estimate (the TTT unroll's prefixes) equals the chain-by-chain
    walk (vLLM's KV cache, each layer's with several)."""
    draft = small_draft(num_layers=layers)
    k, start = 3, 4
    d2t = torch.arange(draft.config.draft_vocab_size)
    seqs = [sequence_following_draft(draft, n, seed) for seed, n in enumerate([40, 33, 27])]
    ref, fast = [], []
    for aux, ids in seqs:
        ref += chains_of_sequence(draft, aux, ids, start, k, d2t)
    # one padded batch for all three sequences
    L = max(ids.numel() for _, ids in seqs)
    aux_b = torch.zeros(len(seqs), L, draft.config.fc_input_size)
    ids_b = torch.zeros(len(seqs), L, dtype=torch.int64)
    lengths = torch.tensor([ids.numel() for _, ids in seqs])
    for j, (aux, ids) in enumerate(seqs):
        aux_b[j, : ids.numel()], ids_b[j, : ids.numel()] = aux, ids
    acc = chain_accepts(draft, aux_b, ids_b, lengths, k, d2t)
    for j in range(len(seqs)):
        fast += walk_chains(acc[j].tolist(), start, int(lengths[j]))
    assert fast == ref
    assert {0, 1, k} <= set(ref), (
        ref
    )  # short and full chains both occur: the comparison means something
    s = summarize_chains(fast, k)
    assert 1.0 < s["acceptance_length"] < k + 1


def test_one_pass_gives_every_k():
    """The k sweep's acceptance for every k from one pass at the largest (verify.num_speculative_
    tokens as a list): capping each chain start's leading matches at k, then walking the chains,
    equals the chain-by-chain walk run at that k."""
    draft = small_draft(1)
    kmax, start = 4, 3
    d2t = torch.arange(draft.config.draft_vocab_size)
    seqs = [sequence_following_draft(draft, n, 10 + seed) for seed, n in enumerate([36, 29])]
    per_k = {}
    for aux, ids in seqs:
        acc = chain_accepts(draft, aux[None], ids[None], torch.tensor([ids.numel()]), kmax, d2t)
        for k in range(1, kmax + 1):
            capped = [min(a, k) for a in acc[0].tolist()]
            got = walk_chains(capped, start, ids.numel())
            assert got == chains_of_sequence(draft, aux, ids, start, k, d2t), k
            per_k.setdefault(k, []).extend(got)
    lengths = [summarize_chains(per_k[k], k)["acceptance_length"] for k in range(1, kmax + 1)]
    assert lengths == sorted(lengths) and lengths[0] < lengths[-1]  # more k, more accepted


def test_a_capped_estimate_covers_every_category():
    """MT-bench conversations arrive grouped; the first 32 of 40 turns left roleplay out of the
    per-category table (measured, 2026-12-06): the cap takes each category in turn."""
    labels = [c for c in "wrmcxsth" for _ in range(5)]  # 8 categories x 5, in blocks
    picked = spread(labels, 32)
    assert picked == sorted(picked) and len(picked) == 32
    assert {labels[i] for i in picked} == set("wrmcxsth")
    assert {labels[i] for i in range(32)} != set("wrmcxsth")  # what the first 32 would miss
    assert spread(labels, 3) == [0, 5, 10]
    assert spread(["a", "a", "b"], 10) == [0, 1, 2]
