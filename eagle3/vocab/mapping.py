"""Draft vocabulary: which target token ids the draft's ``lm_head`` can predict.

An EAGLE-3 draft predicts over a reduced vocabulary (``draft_vocab_size`` rows, 32000 by
default) to keep its ``lm_head`` small. The kept ids are the target's most frequent tokens
among the training positions that carry loss (the assistant's tokens, reasoning included):
a token the draft is never trained to emit is not worth a row.

The checkpoint carries two tensors that vLLM reads:

- ``d2t`` (int64, ``[draft_vocab_size]``): an OFFSET per draft row, not an id. vLLM maps draft
  logit index ``i`` to target id ``i + d2t[i]``. Kept ids are sorted ascending, so offsets are
  non-negative and non-decreasing.
- ``t2d`` (bool, ``[target_vocab_size]``): True for the kept target ids.

A draft whose vocab is smaller than the target's and that has no ``d2t`` loads *silently*
wrong in vLLM (draft row ``i`` is taken to be target id ``i``), so the mapping always has
exactly ``draft_vocab_size`` entries, padded deterministically when the data has fewer
distinct tokens (see :func:`build_vocab`).

Files are safetensors only (no pickle anywhere), written atomically.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from safetensors.torch import save as safetensors_save

from eagle3.atomic import write_bytes_atomic

#: Metadata keys written by :func:`save_vocab` itself; caller metadata may not contradict them.
RESERVED_METADATA = ("coverage", "distinct", "padded", "draft_vocab_size", "target_vocab_size")


@dataclass(frozen=True)
class VocabMapping:
    """The draft <-> target vocabulary mapping and the statistics that justify it.

    Attributes:
        d2t: int64 ``[D]``, ``draft_ids - arange(D)``: the offset vLLM adds to a draft index.
        t2d: bool ``[V]``, True where the target id is in the draft vocab (``t2d.sum() == D``).
        draft_ids: int64 ``[D]``, the kept target ids, strictly ascending.
        coverage: share of loss-carrying tokens whose id is in the draft vocab (0..1). It is the
            ceiling on how often the draft *can* be right, so it is the number to watch when
            choosing ``draft_vocab_size``.
        distinct: number of distinct target ids seen among loss-carrying tokens.
        padded: how many kept ids were never seen (filled in to reach exactly D rows).
        counts: int64 ``[V]``, the frequencies the mapping was built from (kept for audit and
            for re-deriving coverage curves without re-reading the data).
        metadata: extra string metadata (from the caller, or read back by :func:`load_vocab`).
    """

    d2t: torch.Tensor
    t2d: torch.Tensor
    draft_ids: torch.Tensor
    coverage: float
    distinct: int
    padded: int
    counts: torch.Tensor
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def draft_vocab_size(self) -> int:
        return int(self.d2t.numel())

    @property
    def target_vocab_size(self) -> int:
        return int(self.t2d.numel())


def count_tokens(
    sequences: Iterable[tuple[Sequence[int], Sequence[bool | int]]],
    vocab_size: int,
) -> torch.Tensor:
    """Frequencies of target token ids over the positions whose loss mask is true.

    Each item is ``(token_ids, loss_mask)`` of equal length; a nonzero / True mask marks a
    position that carries loss (assistant tokens). Prompt tokens are excluded because the draft
    is never trained to predict them, so they must not buy rows in its vocabulary.

    Every id is range-checked, masked or not: an id outside ``[0, vocab_size)`` means the data
    was tokenised for another model, and counting the rest would quietly build a wrong vocab.

    Returns:
        int64 tensor ``[vocab_size]``.

    Raises:
        ValueError: ``vocab_size`` not positive, ids and mask of different lengths, or an id out
            of range (the message names the id, the sequence index and the position).
    """
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for n, (ids, mask) in enumerate(sequences):
        if isinstance(ids, torch.Tensor) and ids.is_floating_point():
            raise ValueError(f"sequence {n}: token ids must be integers, got dtype {ids.dtype}")
        t = torch.as_tensor(ids, dtype=torch.int64).reshape(-1)
        m = torch.as_tensor(mask).reshape(-1).to(torch.bool)
        if t.numel() != m.numel():
            raise ValueError(f"sequence {n}: {t.numel()} token ids but {m.numel()} mask entries")
        if t.numel() == 0:
            continue
        bad = (t < 0) | (t >= vocab_size)
        if bool(bad.any()):
            pos = int(bad.nonzero()[0, 0])
            raise ValueError(
                f"token id {int(t[pos])} out of range [0, {vocab_size}) "
                f"(sequence {n}, position {pos}): tokenised for another target?"
            )
        kept = t[m]
        # index_add_ rather than bincount(minlength=V): bincount allocates and adds a full [V]
        # tensor per sequence, ~100x slower for short sequences over a 163840-token vocab.
        counts.index_add_(0, kept, torch.ones(kept.numel(), dtype=torch.int64))
    return counts


def _check_counts(counts: torch.Tensor) -> torch.Tensor:
    if counts.dim() != 1 or counts.numel() == 0:
        raise ValueError(f"counts must be a non-empty 1-D tensor, got shape {tuple(counts.shape)}")
    if counts.is_floating_point() or counts.is_complex() or counts.dtype == torch.bool:
        raise ValueError(f"counts must be an integer tensor, got dtype {counts.dtype}")
    counts = counts.to(torch.int64)
    if bool((counts < 0).any()):
        raise ValueError("counts must be non-negative")
    return counts


def _ranking(counts: torch.Tensor) -> torch.Tensor:
    """All target ids by descending count, lower id first among equal counts.

    A stable descending sort keeps the original (ascending id) order among ties, so the result
    is deterministic and does not depend on the sort implementation. Unseen ids (count 0) come
    last, lowest id first: that is the padding rule.
    """
    return torch.sort(counts, descending=True, stable=True).indices


def build_vocab(counts: torch.Tensor, draft_vocab_size: int) -> VocabMapping:
    """Keep the ``draft_vocab_size`` most frequent ids and build ``d2t`` / ``t2d``.

    Rules (all deterministic, so the same data always gives the same checkpoint):

    - Rank ids by count, descending; equal counts: lower id first.
    - Padding: when fewer than ``draft_vocab_size`` distinct ids were seen, the remaining rows go
      to the lowest ids not yet chosen (all unseen ids have count 0, so this is the same ranking
      continued). vLLM needs exactly ``draft_vocab_size`` rows; a padded row costs one unused
      ``lm_head`` row and nothing else. ``padded`` records how many.
    - The kept ids are sorted ascending; ``d2t[i] = draft_ids[i] - i``.

    Raises:
        ValueError: bad counts, ``draft_vocab_size`` outside ``[1, V]``, or no loss-carrying tokens
            at all (a vocab built from nothing would be ids ``0..D-1``: silently useless).
    """
    counts = _check_counts(counts)
    vocab_size = counts.numel()
    if not 0 < draft_vocab_size <= vocab_size:
        raise ValueError(
            f"draft_vocab_size {draft_vocab_size} must be in [1, target vocab size {vocab_size}]"
        )
    total = int(counts.sum())
    if total == 0:
        raise ValueError("no loss-carrying tokens were counted: cannot choose a draft vocabulary")
    kept = _ranking(counts)[:draft_vocab_size]
    draft_ids = torch.sort(kept).values.contiguous()
    d2t = draft_ids - torch.arange(draft_vocab_size, dtype=torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    distinct = int((counts > 0).sum())
    return VocabMapping(
        d2t=d2t,
        t2d=t2d,
        draft_ids=draft_ids,
        coverage=int(counts[draft_ids].sum()) / total,
        distinct=distinct,
        padded=max(0, draft_vocab_size - distinct),
        counts=counts.clone(),
    )


def draft_to_target(d2t: torch.Tensor) -> torch.Tensor:
    """Target ids of the draft rows, the way vLLM reads ``d2t``: ``i + d2t[i]``."""
    return torch.arange(d2t.numel(), dtype=torch.int64) + d2t.to(torch.int64)


def _as_metadata_string(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def save_vocab(m: VocabMapping, path: Path, metadata: dict[str, Any] | None = None) -> None:
    """Write the mapping as safetensors (``d2t``, ``t2d``, ``draft_ids``, ``counts``).

    The header metadata holds coverage, distinct, padded, draft_vocab_size, target_vocab_size
    and the caller's ``metadata`` (non-strings JSON-encoded: safetensors metadata is str -> str).
    A caller key that contradicts a computed one raises ValueError rather than being dropped.

    The file appears atomically (``eagle3.atomic``), so a
    killed run never leaves a half-written vocab that a cache check would take for a finished one.
    """
    path = Path(path)
    header = {
        "coverage": repr(float(m.coverage)),
        "distinct": str(int(m.distinct)),
        "padded": str(int(m.padded)),
        "draft_vocab_size": str(m.draft_vocab_size),
        "target_vocab_size": str(m.target_vocab_size),
    }
    for key, value in (metadata or {}).items():
        text = _as_metadata_string(value)
        if key in header and header[key] != text:
            raise ValueError(
                f"metadata key {key!r}={text!r} contradicts the mapping's {header[key]!r}"
            )
        header[str(key)] = text
    tensors = {
        "d2t": m.d2t.to(torch.int64).contiguous(),
        "t2d": m.t2d.to(torch.bool).contiguous(),
        "draft_ids": m.draft_ids.to(torch.int64).contiguous(),
        "counts": m.counts.to(torch.int64).contiguous(),
    }
    data = safetensors_save(tensors, metadata=header)
    write_bytes_atomic(path, data)


def load_vocab(path: Path) -> VocabMapping:
    """Read a file written by :func:`save_vocab` and check its invariants.

    Checked: ``draft_ids`` strictly ascending and in range, ``i + d2t[i] == draft_ids[i]``,
    ``t2d`` true exactly at ``draft_ids``. A file that fails is refused (ValueError) rather than
    exported into a draft that vLLM would load silently wrong. Metadata other than the reserved
    keys ends up in ``VocabMapping.metadata``.
    """
    path = Path(path)
    tensors = load_file(str(path))
    with safe_open(str(path), framework="pt") as f:
        header = dict(f.metadata() or {})
    missing = [k for k in ("d2t", "t2d", "draft_ids", "counts") if k not in tensors]
    if missing:
        raise ValueError(f"{path}: missing tensors {missing}")
    missing = [k for k in RESERVED_METADATA if k not in header]
    if missing:
        raise ValueError(f"{path}: missing metadata {missing}")
    d2t, t2d, draft_ids, counts = (tensors[k] for k in ("d2t", "t2d", "draft_ids", "counts"))
    if d2t.dtype != torch.int64 or draft_ids.dtype != torch.int64 or t2d.dtype != torch.bool:
        raise ValueError(
            f"{path}: wrong dtypes d2t={d2t.dtype} draft_ids={draft_ids.dtype} t2d={t2d.dtype}"
        )
    d, v = d2t.numel(), t2d.numel()
    if (d, v) != (int(header["draft_vocab_size"]), int(header["target_vocab_size"])):
        raise ValueError(f"{path}: tensor sizes ({d}, {v}) disagree with metadata")
    if draft_ids.numel() != d or counts.numel() != v:
        raise ValueError(f"{path}: draft_ids has {draft_ids.numel()} rows, counts {counts.numel()}")
    if d > 1 and not bool((draft_ids[1:] > draft_ids[:-1]).all()):
        raise ValueError(f"{path}: draft_ids not strictly ascending")
    if bool(((draft_ids < 0) | (draft_ids >= v)).any()):
        raise ValueError(f"{path}: draft_ids out of range [0, {v})")
    if not torch.equal(draft_to_target(d2t), draft_ids):
        raise ValueError(f"{path}: d2t is not the offset draft_ids - arange(D)")
    if int(t2d.sum()) != d or not bool(t2d[draft_ids].all()):
        raise ValueError(f"{path}: t2d does not mark exactly draft_ids")
    return VocabMapping(
        d2t=d2t,
        t2d=t2d,
        draft_ids=draft_ids,
        coverage=float(header["coverage"]),
        distinct=int(header["distinct"]),
        padded=int(header["padded"]),
        counts=counts.to(torch.int64),
        metadata={k: val for k, val in header.items() if k not in RESERVED_METADATA},
    )


def coverage_curve(counts: torch.Tensor, sizes: list[int]) -> list[tuple[int, float]]:
    """Coverage for each candidate ``draft_vocab_size``, in the order given.

    Coverage at size ``s`` is the share of loss-carrying tokens among the ``s`` most frequent
    ids, i.e. exactly ``build_vocab(counts, s).coverage``; one sort serves every size. Use it to
    pick the smallest size past which ``lm_head`` rows buy little.
    """
    counts = _check_counts(counts)
    total = int(counts.sum())
    if total == 0:
        raise ValueError("no loss-carrying tokens were counted: coverage is undefined")
    cumulative = torch.cumsum(counts[_ranking(counts)], dim=0)
    curve: list[tuple[int, float]] = []
    for s in sizes:
        if not 0 < s <= counts.numel():
            raise ValueError(f"size {s} must be in [1, target vocab size {counts.numel()}]")
        curve.append((int(s), int(cumulative[s - 1]) / total))
    return curve
