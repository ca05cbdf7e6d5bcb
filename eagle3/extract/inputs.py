"""Training sequences and loss masks from the generate stage's samples.

The sequence is exactly what the target saw and wrote: the prompt ids (chat template included)
followed by the completion ids (reasoning, answer, end-of-turn token), as the server returned
them. The loss mask covers the completion and nothing else: system and user turns, earlier
turns of a history and the template's headers (including a ``<think>`` the template opened)
are context, not the target's own predictions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3.generate.storage import iter_samples


@dataclass
class Example:
    id: str
    input_ids: list[int]
    loss_mask: list[int]
    truncated_from: int | None = None  # original length when cut to max_seq_len


def build_example(sample: dict[str, Any]) -> Example:
    prompt = list(sample["prompt_token_ids"])
    completion = list(sample["completion_token_ids"])
    return Example(sample["id"], prompt + completion, [0] * len(prompt) + [1] * len(completion))


def out_of_vocab(ids: list[int], vocab_size: int | None) -> int | None:
    """The first id that is not a token of the target (None if all are)."""
    if vocab_size is None:
        return None
    return next((i for i in ids if not 0 <= int(i) < vocab_size), None)


def iter_examples(generate_dir: Path, max_seq_len: int, truncation: str = "truncate",
                  skip: set[str] = frozenset(), vocab_size: int | None = None,
                  on_bad: Callable[[str, str], None] | None = None) -> Iterator[Example | tuple[str, str]]:
    """Examples in storage order; over-long ones are cut (``truncate``) or given back as
    (id, reason) (``skip``). Samples with no loss token, or with an id outside the target's
    vocabulary (the model would index past its embedding), are given back as (id, reason)."""
    for s in iter_samples(generate_dir, on_bad=on_bad):
        if s["id"] in skip:
            continue
        ex = build_example(s)
        bad = out_of_vocab(ex.input_ids, vocab_size)
        if bad is not None:
            yield ex.id, f"token id {bad} outside the target's vocabulary (target.vocab_size {vocab_size})"
            continue
        if not any(ex.loss_mask):
            yield ex.id, "no completion tokens"
            continue
        n = len(ex.input_ids)
        if n > max_seq_len:
            if truncation == "skip":
                yield ex.id, f"{n} tokens > max_seq_len {max_seq_len}"
                continue
            ex = Example(ex.id, ex.input_ids[:max_seq_len], ex.loss_mask[:max_seq_len], truncated_from=n)
            if not any(ex.loss_mask):
                yield ex.id, f"prompt alone fills max_seq_len {max_seq_len}"
                continue
        yield ex
