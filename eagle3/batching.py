"""Length-bucketed batching under a token budget, shared by extraction and training."""

from __future__ import annotations


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
