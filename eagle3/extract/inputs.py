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


def fit_example(
    ex: Example, max_seq_len: int, truncation: str = "truncate", vocab_size: int | None = None
) -> Example | tuple[str, str]:
    """The example cut to ``max_seq_len`` (``truncate``), or (id, reason) when it gives no training
    position: too long under ``skip``, no loss token, or an id outside the target's vocabulary
    (the model would index past its embedding)."""
    bad = out_of_vocab(ex.input_ids, vocab_size)
    if bad is not None:
        return (
            ex.id,
            f"token id {bad} outside the target's vocabulary (target.vocab_size {vocab_size})",
        )
    if not any(ex.loss_mask):
        return ex.id, "no completion tokens"
    n = len(ex.input_ids)
    if n > max_seq_len:
        if truncation == "skip":
            return ex.id, f"{n} tokens > max_seq_len {max_seq_len}"
        ex = Example(
            ex.id, ex.input_ids[:max_seq_len], ex.loss_mask[:max_seq_len], truncated_from=n
        )
        if not any(ex.loss_mask):
            return ex.id, f"prompt alone fills max_seq_len {max_seq_len}"
    return ex


def iter_examples(
    generate_dir: Path,
    max_seq_len: int,
    truncation: str = "truncate",
    skip: set[str] = frozenset(),
    vocab_size: int | None = None,
    on_bad: Callable[[str, str], None] | None = None,
) -> Iterator[Example | tuple[str, str]]:
    """The generate folder's examples in storage order, through ``fit_example``."""
    for s in iter_samples(generate_dir, on_bad=on_bad):
        if s["id"] not in skip:
            yield fit_example(build_example(s), max_seq_len, truncation, vocab_size)
