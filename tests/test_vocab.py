"""Draft vocabulary (eagle3.vocab) against a brute-force reference.

The reference is deliberately naive (collections.Counter + sorted) so that it is obviously
right: rank ids by (-count, id), keep the first D, sort ascending. d2t must be the offset that
vLLM adds (target = i + d2t[i]), never the ids themselves.
"""

from __future__ import annotations

import json
import pickle
import random
import struct
from collections import Counter
from pathlib import Path

import pytest
import torch

from eagle3 import atomic
from eagle3 import vocab as vocab_mod
from eagle3.vocab import (
    build_vocab,
    count_tokens,
    coverage_curve,
    draft_to_target,
    load_vocab,
    plot_coverage,
    save_vocab,
)

# ---------------------------------------------------------------- reference and data


def brute_force(sequences, vocab_size: int, draft_vocab_size: int):
    """(counter, kept ids ascending, coverage, distinct, padded) the slow, obvious way."""
    c: Counter[int] = Counter()
    for ids, mask in sequences:
        for t, m in zip(ids, mask):
            if m:
                c[t] += 1
    ranked = sorted(range(vocab_size), key=lambda t: (-c[t], t))
    kept = sorted(ranked[:draft_vocab_size])
    total = sum(c.values())
    coverage = sum(c[t] for t in kept) / total
    distinct = len(c)
    return c, kept, coverage, distinct, max(0, draft_vocab_size - distinct)


def random_sequences(
    seed: int,
    vocab_size: int,
    n_seq: int,
    max_len: int,
    id_range: int | None = None,
    zipf: bool = True,
):
    """Token sequences with a loss mask: a 'prompt' part (mask 0) then an 'assistant' part (mask 1)
    plus random holes, ids drawn Zipf-like (realistic) or uniformly from a small range (tie-heavy)."""
    rng = random.Random(seed)
    hi = id_range or vocab_size
    weights = [1.0 / (k + 1) for k in range(hi)] if zipf else None
    population = list(range(hi))
    rng.shuffle(population)  # frequent ids must not simply be the low ids
    out = []
    for _ in range(n_seq):
        n = rng.randint(0, max_len)
        ids = rng.choices(population, weights=weights, k=n)
        split = rng.randint(0, n)
        mask = [0] * split + [1 if rng.random() > 0.1 else 0 for _ in range(n - split)]
        if rng.random() < 0.5:
            mask = [bool(x) for x in mask]  # both bool and int masks occur
        out.append((ids, mask))
    return out


def assert_matches_reference(sequences, vocab_size: int, draft_vocab_size: int):
    counts = count_tokens(sequences, vocab_size)
    c, kept, coverage, distinct, padded = brute_force(sequences, vocab_size, draft_vocab_size)
    assert counts.dtype == torch.int64 and counts.shape == (vocab_size,)
    assert counts.tolist() == [c[t] for t in range(vocab_size)]

    m = build_vocab(counts, draft_vocab_size)
    assert (
        m.draft_ids.dtype == torch.int64
        and m.d2t.dtype == torch.int64
        and m.t2d.dtype == torch.bool
    )
    assert m.draft_ids.tolist() == kept
    assert m.d2t.shape == (draft_vocab_size,) and m.t2d.shape == (vocab_size,)
    # d2t is an OFFSET: i + d2t[i] gives back exactly the sorted kept ids.
    assert m.d2t.tolist() == [t - i for i, t in enumerate(kept)]
    assert [i + int(m.d2t[i]) for i in range(draft_vocab_size)] == kept
    assert draft_to_target(m.d2t).tolist() == kept
    assert int(m.t2d.sum()) == draft_vocab_size
    assert m.t2d.nonzero().flatten().tolist() == kept
    assert m.coverage == pytest.approx(coverage, abs=1e-12)
    assert (m.distinct, m.padded) == (distinct, padded)
    assert m.draft_vocab_size == draft_vocab_size and m.target_vocab_size == vocab_size
    return m


# ---------------------------------------------------------------- counting


def test_count_respects_mask():
    seqs = [([5, 5, 7, 9], [0, 1, 1, 0]), ([9, 9, 1], [False, False, True])]
    counts = count_tokens(seqs, 10)
    assert counts.tolist() == [0, 1, 0, 0, 0, 1, 0, 1, 0, 0]
    assert counts[9] == 0, "id 9 only ever appears with mask 0 and must never be counted"


def test_count_accepts_tensors_and_generators_and_empty():
    seqs = (
        x
        for x in [
            (torch.tensor([1, 2, 2], dtype=torch.int32), torch.tensor([1, 1, 1])),
            ([], []),
            (torch.tensor([3]), torch.tensor([True])),
        ]
    )
    assert count_tokens(seqs, 4).tolist() == [0, 1, 2, 1]


def test_masked_tokens_never_counted_random():
    for seed in range(3):
        seqs = random_sequences(seed, 200, 50, 80)
        counts = count_tokens(seqs, 200)
        only_masked = {t for ids, mask in seqs for t, m in zip(ids, mask) if not m} - {
            t for ids, mask in seqs for t, m in zip(ids, mask) if m
        }
        assert all(int(counts[t]) == 0 for t in only_masked)
        assert int(counts.sum()) == sum(bool(m) for _, mask in seqs for m in mask)


@pytest.mark.parametrize("bad", [10, 11, -1, 10**9])
def test_out_of_range_id_raises_naming_it(bad):
    seqs = [([1, 2], [1, 1]), ([3, bad, 4], [1, 0, 1])]  # masked-out does not excuse a wrong id
    with pytest.raises(ValueError, match=rf"token id {bad} out of range.*sequence 1, position 1"):
        count_tokens(seqs, 10)


def test_count_rejects_length_mismatch_and_bad_vocab():
    with pytest.raises(ValueError, match="2 token ids but 3 mask"):
        count_tokens([([1, 2], [1, 1, 1])], 10)
    with pytest.raises(ValueError, match="vocab_size"):
        count_tokens([], 0)
    with pytest.raises(ValueError, match="integers"):
        count_tokens([(torch.tensor([1.0]), [1])], 10)


# ---------------------------------------------------------------- building against the reference


@pytest.mark.parametrize("seed", range(6))
def test_build_matches_brute_force_zipf(seed):
    rng = random.Random(1000 + seed)
    vocab_size = rng.randint(50, 500)
    draft = rng.randint(1, vocab_size)
    seqs = random_sequences(seed, vocab_size, rng.randint(5, 60), 120)
    if not any(m for _, mask in seqs for m in mask):
        seqs.append(([0], [1]))
    assert_matches_reference(seqs, vocab_size, draft)


@pytest.mark.parametrize("seed", range(6))
def test_build_matches_brute_force_tie_heavy(seed):
    # Few distinct ids, uniform draw, tiny counts: many equal counts straddle the cut-off,
    # so the lower-id-first tie-break decides which ids are kept.
    rng = random.Random(2000 + seed)
    vocab_size = 100
    seqs = random_sequences(seed, vocab_size, 8, 6, id_range=40, zipf=False)
    seqs.append(([0], [1]))
    counts = count_tokens(seqs, vocab_size)
    nonzero = sorted(set(counts[counts > 0].tolist()))
    for draft in {1, 3, 7, 15, rng.randint(1, 40)}:
        m = assert_matches_reference(seqs, vocab_size, draft)
        assert m.padded == max(0, draft - m.distinct)
    assert len(nonzero) < int((counts > 0).sum()), "the data should actually contain ties"


def test_tie_break_lower_id_first():
    counts = torch.zeros(10, dtype=torch.int64)
    counts[[8, 2, 5, 1]] = torch.tensor([3, 3, 3, 9])
    assert build_vocab(counts, 3).draft_ids.tolist() == [1, 2, 5]  # 8 loses the tie to 2 and 5
    assert build_vocab(counts, 2).draft_ids.tolist() == [1, 2]


@pytest.mark.parametrize("seed", range(3))
def test_padding_when_fewer_distinct_than_draft(seed):
    vocab_size = 300
    seqs = random_sequences(seed, vocab_size, 10, 20, id_range=60)
    seqs.append(([0], [1]))
    counts = count_tokens(seqs, vocab_size)
    distinct = int((counts > 0).sum())
    draft = distinct + 25
    m = assert_matches_reference(seqs, vocab_size, draft)
    assert m.padded == 25 and m.distinct == distinct
    assert m.coverage == 1.0
    seen = set(counts.nonzero().flatten().tolist())
    pad = sorted(set(m.draft_ids.tolist()) - seen)
    unseen = [t for t in range(vocab_size) if t not in seen]
    assert pad == unseen[:25], "padding takes the lowest ids not yet chosen"


def test_padding_whole_vocab():
    counts = torch.tensor([0, 4, 0, 1, 0], dtype=torch.int64)
    m = build_vocab(counts, 5)
    assert m.draft_ids.tolist() == [0, 1, 2, 3, 4] and m.d2t.tolist() == [0] * 5
    assert m.t2d.all() and m.padded == 3 and m.distinct == 2 and m.coverage == 1.0


def test_d2t_is_offset_not_id():
    counts = torch.zeros(50, dtype=torch.int64)
    counts[[3, 10, 49]] = 1
    m = build_vocab(counts, 3)
    assert m.draft_ids.tolist() == [3, 10, 49]
    assert m.d2t.tolist() == [3, 9, 47]  # not [3, 10, 49]
    assert draft_to_target(m.d2t).tolist() == [3, 10, 49]


def test_coverage_value():
    counts = torch.tensor([10, 0, 5, 1, 4], dtype=torch.int64)  # total 20
    assert build_vocab(counts, 1).coverage == pytest.approx(0.5)
    assert build_vocab(counts, 2).coverage == pytest.approx(0.75)
    assert build_vocab(counts, 3).coverage == pytest.approx(0.95)


def test_build_rejects_bad_input():
    counts = torch.tensor([1, 2, 3])
    for d in (0, -1, 4):
        with pytest.raises(ValueError, match="draft_vocab_size"):
            build_vocab(counts, d)
    with pytest.raises(ValueError, match="no loss-carrying tokens"):
        build_vocab(torch.zeros(5, dtype=torch.int64), 2)
    with pytest.raises(ValueError, match="non-negative"):
        build_vocab(torch.tensor([1, -1, 2]), 2)
    with pytest.raises(ValueError, match="integer"):
        build_vocab(torch.tensor([1.0, 2.0]), 1)
    with pytest.raises(ValueError, match="1-D"):
        build_vocab(torch.ones(2, 2, dtype=torch.int64), 1)


def test_build_is_deterministic_and_does_not_alias_counts():
    counts = count_tokens(random_sequences(7, 400, 40, 100), 400)
    a, b = build_vocab(counts, 64), build_vocab(counts.clone(), 64)
    assert torch.equal(a.d2t, b.d2t) and torch.equal(a.t2d, b.t2d)
    counts.zero_()
    assert int(a.counts.sum()) > 0


# ---------------------------------------------------------------- coverage curve and plot


def test_coverage_curve_matches_build():
    counts = count_tokens(random_sequences(3, 500, 40, 200), 500)
    sizes = [1, 10, 50, 100, 250, 500, 5]
    curve = coverage_curve(counts, sizes)
    assert [s for s, _ in curve] == sizes
    for s, cov in curve:
        assert cov == pytest.approx(build_vocab(counts, s).coverage, abs=1e-12)
    ordered = [c for _, c in sorted(curve)]
    assert ordered == sorted(ordered) and curve[5][1] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="size 501"):
        coverage_curve(counts, [501])
    with pytest.raises(ValueError, match="size 0"):
        coverage_curve(counts, [0])


def test_plot_coverage_writes_png(tmp_path: Path):
    counts = count_tokens(random_sequences(4, 300, 30, 100), 300)
    out = tmp_path / "sub" / "coverage.png"
    plot_coverage(coverage_curve(counts, [1, 8, 32, 128, 300]), out, chosen=32)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in out.parent.iterdir()] == ["coverage.png"]  # no temp files left


# ---------------------------------------------------------------- save / load


def _mapping(seed: int = 0, vocab_size: int = 1000, draft: int = 128):
    seqs = random_sequences(seed, vocab_size, 30, 200)
    return build_vocab(count_tokens(seqs, vocab_size), draft)


def test_save_load_round_trip(tmp_path: Path):
    m = _mapping()
    path = tmp_path / "vocab" / "vocab.safetensors"
    save_vocab(
        m, path, {"target": "HuggingFaceTB/SmolLM2-135M-Instruct", "samples": 30, "hash": "abc"}
    )
    got = load_vocab(path)
    for name in ("d2t", "t2d", "draft_ids", "counts"):
        a, b = getattr(m, name), getattr(got, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert got.coverage == m.coverage  # repr() of a float round-trips exactly
    assert (got.distinct, got.padded) == (m.distinct, m.padded)
    assert got.metadata == {
        "target": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "samples": "30",
        "hash": "abc",
    }
    assert [p.name for p in path.parent.iterdir()] == ["vocab.safetensors"]  # no temp file left


def test_saved_file_is_plain_safetensors_with_string_metadata(tmp_path: Path):
    m = _mapping(1, 500, 300)
    path = tmp_path / "v.safetensors"
    save_vocab(m, path, {"draft_vocab_size": 300})  # agreeing with the mapping is allowed
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    meta = header.pop("__metadata__")
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items())
    assert {
        "coverage",
        "distinct",
        "padded",
        "draft_vocab_size",
        "target_vocab_size",
    } <= meta.keys()
    assert meta["draft_vocab_size"] == "300" and meta["target_vocab_size"] == "500"
    assert header["d2t"]["dtype"] == "I64" and header["d2t"]["shape"] == [300]
    assert header["t2d"]["dtype"] == "BOOL" and header["t2d"]["shape"] == [500]
    assert header["draft_ids"]["dtype"] == "I64" and header["counts"]["dtype"] == "I64"


def test_save_rejects_contradicting_metadata(tmp_path: Path):
    with pytest.raises(ValueError, match="contradicts"):
        save_vocab(_mapping(), tmp_path / "v.safetensors", {"draft_vocab_size": 7})
    assert not any(tmp_path.iterdir())


def test_save_is_atomic_on_failure(tmp_path: Path, monkeypatch):
    path = tmp_path / "v.safetensors"
    save_vocab(_mapping(0), path, {})
    before = path.read_bytes()

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(atomic.os, "replace", boom)
    with pytest.raises(OSError):
        save_vocab(_mapping(1), path, {})
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["v.safetensors"]


def test_load_refuses_inconsistent_file(tmp_path: Path):
    from safetensors.torch import save_file

    m = _mapping()
    path = tmp_path / "bad.safetensors"
    meta = {
        "coverage": "1.0",
        "distinct": "1",
        "padded": "0",
        "draft_vocab_size": str(m.draft_vocab_size),
        "target_vocab_size": str(m.target_vocab_size),
    }
    # d2t holding ids instead of offsets: the bug that makes vLLM load silently wrong.
    save_file(
        {"d2t": m.draft_ids.clone(), "t2d": m.t2d, "draft_ids": m.draft_ids, "counts": m.counts},
        str(path),
        meta,
    )
    with pytest.raises(ValueError, match="offset"):
        load_vocab(path)
    t2d = m.t2d.clone()
    t2d[int(torch.nonzero(~t2d)[0])] = True
    save_file(
        {"d2t": m.d2t, "t2d": t2d, "draft_ids": m.draft_ids, "counts": m.counts}, str(path), meta
    )
    with pytest.raises(ValueError, match="t2d"):
        load_vocab(path)
    save_file({"d2t": m.d2t, "t2d": m.t2d, "counts": m.counts}, str(path), meta)
    with pytest.raises(ValueError, match="missing tensors"):
        load_vocab(path)


def test_no_pickle_anywhere(tmp_path: Path, monkeypatch):
    source = Path(vocab_mod.__file__).read_text()
    for forbidden in (
        "import pickle",
        "pickle.",
        "torch.save",
        "torch.load",
        "numpy.save",
        "np.save",
    ):
        assert forbidden not in source, forbidden

    def refuse(*a, **k):
        raise AssertionError("pickle used")

    for name in ("dump", "dumps", "load", "loads", "Pickler", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(torch, "save", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    path = tmp_path / "v.safetensors"
    m = _mapping()
    save_vocab(m, path, {"k": "v"})
    assert torch.equal(load_vocab(path).d2t, m.d2t)
    assert path.read_bytes()[:2] not in (
        b"\x80\x02",
        b"\x80\x04",
        b"PK",
    )  # not a pickle or torch zip


def test_library_has_no_prefect_import():
    assert "prefect" not in Path(vocab_mod.__file__).read_text().lower()
