"""Length-bucketed batching under a token budget, shared by extraction and training."""

from __future__ import annotations

import random


def token_budget_batches(lengths: list[int], token_budget: int) -> list[list[int]]:
    """Indices grouped by similar length so that ``len(batch) * longest <= token_budget``.

    Sorting by length keeps padding small; a sequence longer than the budget gets a batch of
    its own rather than being dropped.
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    cur: list[int] = []
    longest = 0
    for i in order:
        n = lengths[i]
        if cur and max(longest, n) * (len(cur) + 1) > token_budget:
            batches.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        batches.append(cur)
    return batches


def shuffled_budget_batches(
    lengths: list[int], token_budget: int, seed: int, window: int = 64
) -> list[list[int]]:
    """Batches whose composition changes with ``seed`` (one seed per epoch), padding still small.

    :func:`token_budget_batches` over all samples gives the same batches every epoch (only their
    order changes): the same few samples of one length are always averaged together. Here a seeded
    permutation of the samples is cut into windows of about ``window`` batches' worth of tokens,
    each window is length-bucketed on its own, and all batches are shuffled: every epoch sees new
    mixtures (as a packed row of random documents does) at a padding cost close to the sorted one.
    """
    rng = random.Random(seed)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    batches: list[list[int]] = []
    chunk: list[int] = []
    tokens = 0
    for i in order + [-1]:
        if i < 0 or (chunk and tokens + lengths[i] > window * token_budget):
            batches += [
                [chunk[j] for j in b]
                for b in token_budget_batches([lengths[j] for j in chunk], token_budget)
            ]
            chunk, tokens = [], 0
        if i >= 0:
            chunk.append(i)
            tokens += lengths[i]
    rng.shuffle(batches)
    return batches


def packed_budget_batches(lengths: list[int], token_budget: int, seed: int) -> list[list[int]]:
    """Random documents up to ``token_budget`` real tokens per batch: what one packed row of
    speculators' trainer holds (documents drawn in random order, packed until the row is full,
    attention kept within each document), here as one padded row per document, which keeps
    attention within documents for free and costs the padding (up to longest x count). A
    document longer than the budget gets a batch of its own."""
    order = list(range(len(lengths)))
    random.Random(seed).shuffle(order)
    batches: list[list[int]] = []
    cur: list[int] = []
    tokens = 0
    for i in order:
        if cur and tokens + lengths[i] > token_budget:
            batches.append(cur)
            cur, tokens = [], 0
        cur.append(i)
        tokens += lengths[i]
    if cur:
        batches.append(cur)
    return batches
