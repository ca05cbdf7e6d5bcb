"""Prompt lookup (n-gram) speculation simulated over exact token ids: the free baseline a trained
draft has to beat.

vLLM 0.32's proposer semantics (longest n-gram, FIRST occurrence, up to k following tokens) and
why there are two acceptance lengths (vLLM's ``/metrics`` count only proposing steps; an EAGLE
draft proposes at every step): docs/verify.md, "The n-gram baseline". ``tests/test_ngram.py``
runs vLLM's own ``_find_longest_matched_ngram_and_propose_tokens`` against this module.

The chain walk is :func:`eagle3.verify.offline.chains_of_sequence`'s: chain start p = P-1 (the
target has just emitted x[p+1]); the proposer sees x[:p+2]; accepted a = leading matches of the
proposal with x[p+2 : p+2+k]; the next chain starts at p + a + 1; the last chain is cut to the
tokens that exist.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class NgramIndex:
    """A growing context with the first occurrence of every n-gram (n_min <= n <= n_max) that is
    followed by at least one token, so each proposal costs O(n_max) instead of a scan."""

    def __init__(self, n_min: int = 1, n_max: int = 4) -> None:
        if n_min < 1 or n_max < n_min:
            raise ValueError(f"need 1 <= n_min <= n_max, got n_min={n_min}, n_max={n_max}")
        self.n_min, self.n_max = n_min, n_max
        self.tokens: list[int] = []
        self.first: dict[tuple[int, ...], int] = {}  # n-gram -> start of its first occurrence

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            # the n-grams ending at the current last token get a following token now
            end = len(self.tokens)  # exclusive end of those n-grams
            for n in range(self.n_min, min(self.n_max, end) + 1):
                self.first.setdefault(tuple(self.tokens[end - n : end]), end - n)
            self.tokens.append(int(t))

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens after the first earlier occurrence of the longest matching suffix."""
        total = len(self.tokens)
        if k <= 0:
            return []
        for n in range(min(self.n_max, total - 1), self.n_min - 1, -1):
            start = self.first.get(tuple(self.tokens[total - n :]))
            if start is not None:
                return self.tokens[start + n : start + n + k]
        return []


def propose_ngram(context: Sequence[int], k: int, n_min: int = 1, n_max: int = 4) -> list[int]:
    """vLLM's n-gram proposal for ``context``: at most ``k`` tokens, ``[]`` for no match."""
    idx = NgramIndex(n_min, n_max)
    idx.extend(context)
    return idx.propose(k)


class NgramChains(list):
    """Accepted tokens (0..k) per chain, a plain ``list[int]``; ``proposed`` holds how many tokens
    were proposed in each chain (0: no match, vLLM counts no draft for that step), ``unchecked``
    how many proposed tokens could not be checked because the sequence ended while all before them
    matched (only a last chain: vLLM, which still had the target's logits there, may have accepted
    them before cutting the output at max_tokens or a stop token)."""

    def __init__(
        self,
        accepted: Sequence[int] = (),
        proposed: Sequence[int] = (),
        unchecked: Sequence[int] = (),
    ) -> None:
        super().__init__(accepted)
        self.proposed: list[int] = list(proposed)
        self.unchecked: list[int] = list(unchecked)

    @property
    def no_proposal(self) -> int:
        """Chains (target steps) where the proposer found nothing."""
        return sum(1 for p in self.proposed if p == 0)


def leading_matches(proposal: Sequence[int], truth: Sequence[int]) -> int:
    """How many proposed tokens the target accepts: the length of the common prefix."""
    a = 0
    for d, t in zip(proposal, truth):
        if d != t:
            break
        a += 1
    return a


def ngram_chains(
    prompt: Sequence[int], output: Sequence[int], k: int, n_min: int = 1, n_max: int = 4
) -> NgramChains:
    """Accepted count of each chain along prompt + output (the offline estimate's chain walk).

    The result is a list of ints; ``.proposed`` gives the tokens proposed per chain and
    ``.no_proposal`` the number of chains that proposed nothing."""
    x = [int(t) for t in prompt] + [int(t) for t in output]
    L = len(x)
    start = len(prompt) - 1
    out = NgramChains()
    if start < 0 or L - start < 3:
        return out
    idx = NgramIndex(n_min, n_max)
    p = start
    idx.extend(x[: p + 2])
    while p + 2 <= L - 1:
        proposal = idx.propose(k)
        truth = x[p + 2 : p + 2 + k]
        a = leading_matches(proposal, truth)
        out.append(a)
        out.proposed.append(len(proposal))
        out.unchecked.append(len(proposal) - a if a == len(truth) < len(proposal) else 0)
        nxt = p + a + 1
        idx.extend(x[p + 2 : nxt + 2])
        p = nxt
    return out


def simulate_ngram(
    sequences: Sequence[tuple[Sequence[int], Sequence[int]]], k: int, n_min: int = 1, n_max: int = 4
) -> dict[str, Any]:
    """:func:`eagle3.verify.offline.summarize_chains`'s dict over every chain of ``sequences`` =
    [(prompt_token_ids, output_token_ids)], plus what vLLM's counters would say (proposing steps
    only): ``proposing_chains``, ``acceptance_length_proposing``, ``acceptance_rate_proposing``
    (accepted / proposed tokens) and ``acceptance_per_position_proposing``; the totals
    ``accepted_tokens``, ``proposed_tokens`` and ``unchecked_tokens``.

    Run on a server's own outputs, ``proposing_chains`` and ``proposed_tokens`` are vLLM's
    ``num_drafts`` and ``num_draft_tokens`` exactly; its ``num_accepted_tokens`` lies in
    [accepted_tokens, accepted_tokens + unchecked_tokens] (seen on vLLM 0.32 CPU:
    tests/test_verify.py)."""
    from eagle3.verify.offline import summarize_chains

    accepted: list[int] = []
    proposed: list[int] = []
    unchecked = 0
    used = 0
    for prompt, output in sequences:
        if not prompt or len(output) < 2:
            continue
        c = ngram_chains(prompt, output, k, n_min, n_max)
        accepted += c
        proposed += c.proposed
        unchecked += sum(c.unchecked)
        used += 1
    acc_p = [a for a, n in zip(accepted, proposed) if n > 0]
    m = len(acc_p)
    return {
        **summarize_chains(accepted, k),
        "proposing_chains": m,
        "acceptance_length_proposing": 1 + sum(acc_p) / m if m else None,
        "acceptance_rate_proposing": sum(acc_p) / sum(proposed) if m else None,
        "acceptance_per_position_proposing": [sum(1 for a in acc_p if a > i) / m for i in range(k)]
        if m
        else [],
        "accepted_tokens": sum(accepted),
        "proposed_tokens": sum(proposed),
        # proposed tokens past the end of a sequence after a fully matching prefix: vLLM's accepted
        # count may exceed accepted_tokens by up to this many (it verifies them, then cuts the
        # output)
        "unchecked_tokens": unchecked,
        "sequences": used,
        "k": k,
        "n_min": n_min,
        "n_max": n_max,
    }


def vllm_ngram_config(k: int, n_min: int = 1, n_max: int = 4) -> dict[str, Any]:
    """The ``--speculative-config`` that serves this baseline in vLLM (works on vLLM CPU with
    -O0)."""
    return {
        "method": "ngram",
        "num_speculative_tokens": k,
        "prompt_lookup_max": n_max,
        "prompt_lookup_min": n_min,
    }
