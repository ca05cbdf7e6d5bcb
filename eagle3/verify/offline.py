"""Acceptance estimated in PyTorch alone: the target's greedy sequences, the draft's greedy chains.

For quick checks (during training, or before paying for two server starts) and as a cross-check
of vLLM's counters. For each sequence ``x`` (prompt + the target's own greedy continuation,
length L, prompt length P) the target's auxiliary states ``a`` come from one teacher-forced
forward pass (exactly what the target computed while generating ``x``). Then, as vLLM's
proposer does after every verification step:

    chain start p (first p = P-1: the target has just emitted x[p+1] from its state at p)
      step 0:  draft(a_p, x[p+1]) at position p           -> d_1   (prefix keys: a_0..a_p)
      step i:  draft(out_{i-1}, d_i) at position p+i      -> d_{i+1}
      accepted a = leading matches of d_1..d_k with x[p+2..p+1+k]
      the target's verification emits one more token, so the next chain starts at p + a + 1

Mean acceptance length = mean over chains of (a + 1), the same definition as vLLM's
``1 + accepted / drafts``. Differences from vLLM: float32 here vs the server's dtype, and the
last chain of each sequence (vLLM stops at max_tokens with a partial chain) is cut to the
tokens that exist.

:func:`offline_acceptance` also simulates the n-gram (prompt lookup) baseline on the same
sequences with the same chain walk (``eagle3.verify.ngram``), so the draft's estimate comes with
the number it has to beat.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from eagle3.draft.common import extend_prefix, per_layer
from eagle3.verify.ngram import leading_matches, simulate_ngram


def _slice_kv(kv: Any, n: int) -> Any:
    """The first ``n`` positions of a KV prefix (each layer's)."""
    return per_layer(lambda layer: tuple(t[:, :, :n] for t in layer), kv)


@torch.no_grad()
def chains_of_sequence(
    draft: Any,
    aux: torch.Tensor,
    ids: torch.Tensor,
    start: int,
    k: int,
    draft_to_target: torch.Tensor,
) -> list[int]:
    """Accepted draft tokens (0..k) of each chain along one sequence.

    ``aux`` [L, A*H] target states, ``ids`` [L] tokens, ``start`` = P-1, ``draft_to_target`` [D]
    maps a draft index to its target id."""
    L = ids.numel()
    if L - start < 3:
        return []
    out0, logits0, kv0 = draft(ids[1:].unsqueeze(0), aux[:-1].unsqueeze(0), use_cache=True)
    accepted: list[int] = []
    p = start
    while p + 2 <= L - 1:
        tok = draft_to_target[logits0[0, p].argmax()]
        proposals = [int(tok)]
        h, kv = out0[:, p : p + 1], _slice_kv(kv0, p + 1)
        for i in range(1, k):
            pos = torch.tensor([p + i], device=ids.device)
            o, lg, kv_new = draft(tok.view(1, 1), h, position_ids=pos, past_kv=kv, use_cache=True)
            kv = extend_prefix(kv, kv_new)
            tok = draft_to_target[lg[0, -1].argmax()]
            proposals.append(int(tok))
            h = o
        a = leading_matches(proposals, ids[p + 2 : p + 2 + k].tolist())
        accepted.append(a)
        p += a + 1
    return accepted


@torch.no_grad()
def chain_accepts(
    draft: Any,
    aux: torch.Tensor,
    ids: torch.Tensor,
    lengths: torch.Tensor,
    k: int,
    draft_to_target: torch.Tensor,
    parallel: bool = False,
) -> torch.Tensor:
    """Accepted draft tokens (0..k) of a chain started at EVERY position, for a padded batch.

    ``aux`` [B, L, A*H], ``ids`` [B, L] (right padded), ``lengths`` [B]. Returns int64 [B, L]:
    ``acc[b, p]`` = leading matches of the chain that starts after the target emitted x[p+1].

    Why this equals :func:`chains_of_sequence` with one forward per draft step instead of one per
    chain and step: a chain's step i only matters while steps 0..i-1 matched, and then the token
    it was fed (its own guess) IS the true token x[p+1+i]. So feeding the true tokens to every
    position at once (the training-time-test unroll: step i at row p sees the step-0 keys <= p
    and the keys of its own earlier steps at row p, RoPE position p+i) gives the same leading
    matches. ``tests/test_offline_estimate.py`` checks the two agree.

    ``parallel``: the draft proposes its k tokens in one pass (vLLM's ``parallel_drafting``):
    positions 1.. of the chain are the parallel depths of the training unroll, which never read
    a guess, so they are exact at every row as well."""
    from types import SimpleNamespace

    from eagle3.train import shift_left, ttt_unroll

    b, L = ids.shape
    pos = torch.arange(L, device=ids.device)
    valid = torch.ones(b, L, dtype=torch.bool, device=ids.device)
    acc = torch.zeros(b, L, dtype=torch.int64, device=ids.device)
    steps, depths = (1, k) if parallel else (k, 0)
    for i, _, logits in ttt_unroll(
        draft, SimpleNamespace(input_ids=ids, aux=aux), steps, depths
    ):  # the training unroll
        guess = draft_to_target[logits.argmax(-1)]
        exists = (pos + 2 + i)[None, :] < lengths[:, None]
        valid = valid & exists & (guess == shift_left(ids, 2 + i, -1))
        acc += valid.long()
    return acc


def walk_chains(acc: Sequence[int], start: int, length: int) -> list[int]:
    """The chains vLLM's proposer runs along one sequence, given the accepted count at every start:
    the first starts at ``start`` (= prompt length - 1), each next one after the accepted tokens
    plus the target's own token (``p += a + 1``), while a token to check remains."""
    out, p = [], start
    while p + 2 <= length - 1:
        a = int(acc[p])
        out.append(a)
        p += a + 1
    return out


def capped_chains(walks: Sequence[Sequence[Any]], k: int) -> list[int]:
    """The chains of every walk (accepted counts at every start, start, length) with each count
    capped at ``k``: what vLLM's proposer runs at that k (it walks them anew at each k)."""
    return [a for acc, p, n, *_ in walks for a in walk_chains([min(x, k) for x in acc], p, n)]


def summarize_chains(accepted: Sequence[int], k: int) -> dict[str, Any]:
    n = len(accepted)
    if n == 0:
        return {"chains": 0, "acceptance_length": None, "acceptance_per_position": []}
    return {
        "chains": n,
        "acceptance_length": 1 + sum(accepted) / n,
        "acceptance_rate": sum(accepted) / (n * k),
        "acceptance_per_position": [sum(1 for a in accepted if a > i) / n for i in range(k)],
    }


def load_draft_for_eval(
    draft_dir: str | Path, target_dir: str | Path, device: str = "cpu"
) -> tuple[Any, torch.Tensor]:
    """(the exported draft in float32 with the target's embedding, eval mode on ``device``;
    the draft-index -> target-id map [D])."""
    from eagle3.draft.export import load_exported

    draft, d2t, _ = load_exported(draft_dir, dtype=torch.float32)
    draft.load_embeddings(target_dir)
    draft.eval().to(device)
    draft_to_target = torch.arange(draft.config.draft_vocab_size, dtype=torch.int64)
    if d2t is not None:
        draft_to_target = draft_to_target + d2t.to(torch.int64)
    return draft, draft_to_target.to(device)


def spread(labels: Sequence[str | None], n: int) -> list[int]:
    """The indices of at most ``n`` items, taken from each label in turn (in order within each),
    returned in their original order: a capped estimate still covers every group (every MT-bench
    category), where the first ``n`` could leave one out."""
    if n >= len(labels):
        return list(range(len(labels)))
    by_label: dict[str | None, list[int]] = {}
    for i, g in enumerate(labels):
        by_label.setdefault(g, []).append(i)
    queues = [iter(q) for q in by_label.values()]
    picked: list[int] = []
    while len(picked) < n:
        for q in queues:
            i = next(q, None)
            if i is not None and len(picked) < n:
                picked.append(i)
    return sorted(picked)


@torch.no_grad()
def offline_acceptance(
    target_dir: str | Path,
    draft_dir: str | Path,
    sequences: Sequence[tuple[list[int], list[int]]],
    k: int,
    *,
    max_sequences: int | None = None,
    device: str = "cpu",
    ngram_lookup: tuple[int, int] | None = (1, 4),
    ks: Sequence[int] = (),
    groups: Sequence[str | None] | None = None,
    parallel: bool = False,
) -> dict[str, Any]:
    """Estimate acceptance of the exported draft in ``draft_dir`` for the target in ``target_dir``
    on ``sequences`` = [(prompt_token_ids, greedy_output_token_ids)].

    ``ngram_lookup`` = (prompt_lookup_min, prompt_lookup_max): the result's ``ngram`` is the n-gram
    baseline simulated on the same sequences (:func:`eagle3.verify.ngram.simulate_ngram`); None:
    skip. ``ks``: also ``by_k`` = {k: the same for every k in ``ks``}, from ONE pass at the
    largest k (a chain's leading matches at a smaller k are its matches at the largest, capped).
    ``groups`` (one label per sequence, e.g. the MT-bench category): also ``by_group`` (in
    each ``by_k`` entry too); ``max_sequences`` of them are then taken from each group in turn
    (:func:`spread`). ``parallel``: served with parallel drafting (:func:`chain_accepts`)."""
    from transformers import AutoModelForCausalLM

    from eagle3.target_checkpoint import checkpoint_dir

    target_dir = checkpoint_dir(target_dir)
    draft, draft_to_target = load_draft_for_eval(draft_dir, target_dir, device)
    aux_layers = list(draft.config.aux_layer_ids)
    target = (
        AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).to(device).eval()
    )
    kmax = max([k, *ks])
    walks: list[tuple[list[int], int, int, str | None]] = []  # (acc at kmax, start, length, group)
    scored: list[tuple[list[int], list[int]]] = []
    labels = list(groups) if groups is not None else [None] * len(sequences)
    picked = spread(labels, max_sequences or len(sequences))
    for (prompt, output), group in ((sequences[i], labels[i]) for i in picked):
        if not prompt or len(output) < 2:
            continue
        scored.append((list(prompt), list(output)))
        ids = torch.tensor(list(prompt) + list(output), dtype=torch.int64, device=device)
        hs = target(ids.unsqueeze(0), output_hidden_states=True).hidden_states
        aux = torch.cat([hs[layer][0] for layer in aux_layers], dim=-1)
        acc = chain_accepts(
            draft,
            aux[None],
            ids[None],
            torch.tensor([ids.numel()], device=device),
            kmax,
            draft_to_target,
            parallel,
        )
        walks.append((acc[0].tolist(), len(prompt) - 1, ids.numel(), group))

    def at(kk: int, which: Sequence[int]) -> dict[str, Any]:
        chains = capped_chains([walks[i] for i in which], kk)
        seqs = [scored[i] for i in which]
        ngram = simulate_ngram(seqs, kk, *ngram_lookup) if ngram_lookup is not None else None
        return {**summarize_chains(chains, kk), "sequences": len(which), "k": kk, "ngram": ngram}

    names = sorted({str(w[3]) for w in walks}) if groups is not None else []
    members = {g: [i for i, w in enumerate(walks) if str(w[3]) == g] for g in names}

    def with_groups(kk: int) -> dict[str, Any]:
        r = at(kk, range(len(walks)))
        if groups is not None:
            r["by_group"] = {g: at(kk, members[g]) for g in names}
        return r

    at_k = with_groups(k)
    out = dict(at_k)
    if ks:
        out["by_k"] = {kk: at_k if kk == k else with_groups(kk) for kk in ks}
    return out
