"""The n-gram (prompt lookup) baseline simulated over exact tokens: hand-made sequences, and the
same answers as vLLM's own proposer function (read from .venv-vllm's source, run without vLLM)."""

from __future__ import annotations

import ast
import random
from pathlib import Path

import pytest

from eagle3.verify.ngram import NgramChains, ngram_chains, propose_ngram, simulate_ngram
from eagle3.verify.offline import summarize_chains

ROOT = Path(__file__).resolve().parents[1]


def test_propose_longest_match_first_occurrence():
    # suffix [1, 2]: the bigram occurs at 0 (followed by 3) and at 4 (followed by 9): the first wins
    assert propose_ngram([1, 2, 3, 4, 1, 2, 9, 5, 1, 2], k=2) == [3, 4]
    # a longer match beats an earlier shorter one: [7, 1, 2] occurs once, at 4
    assert propose_ngram([1, 2, 3, 0, 7, 1, 2, 8, 8, 7, 1, 2], k=3) == [8, 8, 7]
    # n_max caps the match: with n_max=1 only the last token counts, and its first occurrence is at 1
    assert propose_ngram([1, 2, 3, 0, 7, 1, 2, 8, 8, 7, 1, 2], k=3, n_max=1) == [3, 0, 7]


def test_propose_short_and_empty():
    assert propose_ngram([5, 6, 7, 5], k=3) == [6, 7, 5]
    # fewer than k tokens follow the match: the proposal stops at the end of the context
    assert propose_ngram([5, 6, 5], k=3) == [6, 5]
    assert propose_ngram([1, 1, 1, 1], k=3) == [1]  # overlapping occurrence, one token follows it
    assert propose_ngram([1, 2, 3, 4], k=3) == []  # no earlier occurrence
    assert propose_ngram([], k=3) == [] and propose_ngram([4], k=3) == []
    # n_min: a unigram match alone is not enough with n_min=2
    assert propose_ngram([5, 6, 9, 5], k=2, n_min=2) == []
    assert propose_ngram([3, 5, 6, 3, 5], k=2, n_min=2) == [6, 3]
    with pytest.raises(ValueError):
        propose_ngram([1, 2], k=1, n_min=3, n_max=2)


def test_chains_on_a_repeating_output():
    # prompt 0..4, then the output repeats the prompt: every chain proposes the continuation and is
    # right (the context always holds the period), so every full chain accepts k
    prompt = [10, 11, 12, 13, 14]
    output = [10, 11, 12, 13, 14] * 4
    c = ngram_chains(prompt, output, k=3)
    assert isinstance(c, NgramChains) and isinstance(c, list)
    assert c[:-1] == [3] * (len(c) - 1) and c.no_proposal == 0
    # chain starts advance by a + 1; together they emit the output after its first token (the last
    # chain's bonus token may lie past the end: that chain is cut to the tokens that exist)
    assert sum(a + 1 for a in c) - 1 <= len(output) - 1 <= sum(a + 1 for a in c)


def test_chains_walk_by_hand():
    # prompt [1, 2, 3], output [4, 1, 2, 3, 9, 9]; x = 1 2 3 4 1 2 3 9 9 (P = 3)
    #  p=2: context 1 2 3 4      -> no match (4 is new)            a=0, next p=3
    #  p=3: context 1 2 3 4 1    -> [1] first at 0 -> 2 3 4 vs truth 2 3 9: a=2, next p=6
    #  p=6: context x[:8] = ... 3 9 -> no match (9 is new)         a=0, next p=7
    #  p=7: would check x[9], which does not exist (L = 9): the walk stops
    c = ngram_chains([1, 2, 3], [4, 1, 2, 3, 9, 9], k=3)
    assert list(c) == [0, 2, 0]
    assert c.proposed == [0, 3, 0] and c.no_proposal == 2
    s = simulate_ngram([([1, 2, 3], [4, 1, 2, 3, 9, 9])], k=3)
    assert s == {**summarize_chains([0, 2, 0], 3), **s}  # the offline estimate's format, plus:
    assert s["chains"] == 3 and s["acceptance_length"] == pytest.approx(1 + 2 / 3)
    assert s["proposing_chains"] == 1 and s["acceptance_length_proposing"] == pytest.approx(3.0)
    assert s["acceptance_per_position_proposing"] == [1.0, 1.0, 0.0]
    assert s["acceptance_rate_proposing"] == pytest.approx(2 / 3) and s["proposed_tokens"] == 3


def test_partial_proposal_counts_only_what_was_proposed():
    # p=2: context 7 8 7 -> [7] first at 0 -> proposes only [8, 7] (2 of k=3 tokens follow)
    c = ngram_chains([7, 8], [7, 8, 7, 5, 5], k=3)
    assert c.proposed[0] == 2 and c[0] == 2
    s = simulate_ngram([([7, 8], [7, 8, 7, 5, 5])], k=3)
    assert s["proposed_tokens"] == sum(c.proposed)


def test_unchecked_tokens_at_the_end():
    # x = 5 6 7 8 5 6: the only chain proposes 6 7 8 after [5]; only x[5] = 6 exists to check it
    c = ngram_chains([5, 6, 7, 8], [5, 6], k=3)
    assert list(c) == [1] and c.proposed == [3] and c.unchecked == [2]
    # a mismatch before the end: nothing is left unchecked (vLLM rejects there too)
    c = ngram_chains([5, 6, 7, 8], [5, 9], k=3)
    assert list(c) == [0] and c.unchecked == [0]
    s = simulate_ngram([([5, 6, 7, 8], [5, 6]), ([5, 6, 7, 8], [5, 9])], k=3)
    assert s["accepted_tokens"] == 1 and s["proposed_tokens"] == 6 and s["unchecked_tokens"] == 2


def test_simulate_skips_degenerate_and_handles_no_proposals():
    s = simulate_ngram([([], [1, 2, 3]), ([1], [2])], k=3)
    assert s["chains"] == 0 and s["sequences"] == 0 and s["acceptance_length_proposing"] is None
    s = simulate_ngram([([1, 2, 3], [4, 5, 6, 7])], k=3)
    assert s["chains"] == 3 and s["proposing_chains"] == 0 and s["acceptance_length"] == 1.0
    assert s["acceptance_length_proposing"] is None and s["acceptance_per_position_proposing"] == []


def _vllm_proposer():
    """vLLM's own ``_find_longest_matched_ngram_and_propose_tokens``, taken from its source file
    and run as plain Python (numba's decorator dropped): no vLLM import needed."""
    np = pytest.importorskip("numpy")
    found = sorted(
        ROOT.glob(".venv-vllm/lib/python3*/site-packages/vllm/v1/spec_decode/ngram_proposer.py")
    )
    if not found:
        pytest.skip("no .venv-vllm with vLLM's ngram_proposer.py (make vllm-env)")
    tree = ast.parse(found[0].read_text())
    fn = next(
        n
        for n in tree.body
        if isinstance(n, ast.FunctionDef)
        and n.name == "_find_longest_matched_ngram_and_propose_tokens"
    )
    fn.decorator_list = []
    ns: dict = {"np": np}
    exec(compile(ast.Module([fn], type_ignores=[]), str(found[0]), "exec"), ns)
    f = ns[fn.name]

    def propose(ctx: list[int], k: int, n_min: int, n_max: int) -> list[int]:
        return f(np.array(ctx, dtype=np.int32), n_min, n_max, 1 << 20, k).tolist()

    return propose


def test_same_proposals_as_vllms_own_function():
    vllm_propose = _vllm_proposer()
    rng = random.Random(0)
    proposed = empty = 0
    for _ in range(1500):
        n_min = rng.randint(1, 3)
        n_max = rng.randint(n_min, 5)
        k = rng.randint(1, 5)
        vocab = rng.choice([2, 3, 5, 20])
        ctx = [rng.randrange(vocab) for _ in range(rng.randint(0, 40))]
        if rng.random() < 0.3 and len(ctx) > 6:  # plant a repeat of a longer n-gram
            i = rng.randrange(len(ctx) - 5)
            ctx += ctx[i : i + rng.randint(2, 6)]
        ours = propose_ngram(ctx, k, n_min, n_max)
        assert ours == vllm_propose(ctx, k, n_min, n_max), (ctx, k, n_min, n_max)
        proposed, empty = proposed + bool(ours), empty + (not ours)
    # both outcomes compared many times (two proposers that never propose would agree too)
    print(f"{proposed} proposals, {empty} empty")
    assert proposed >= 300 and empty >= 300, (proposed, empty)
