"""Draft vocabulary: the mapping (d2t / t2d, :mod:`eagle3.vocab.mapping`) and the stage that
builds it from extract's data (:mod:`eagle3.vocab.runner`)."""

from eagle3.vocab.mapping import (
    RESERVED_METADATA,
    VocabMapping,
    build_vocab,
    count_tokens,
    coverage_curve,
    draft_to_target,
    load_vocab,
    save_vocab,
)
from eagle3.vocab.runner import plot_coverage, vocab_stage

__all__ = [
    "RESERVED_METADATA",
    "VocabMapping",
    "build_vocab",
    "count_tokens",
    "coverage_curve",
    "draft_to_target",
    "load_vocab",
    "plot_coverage",
    "save_vocab",
    "vocab_stage",
]
