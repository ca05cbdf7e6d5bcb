"""The hero run's closing verdict (flows/verdict.py, flows/hero_report.py) on saved report dicts:
the figures of `make demo`'s fresh-clone run of 2026-12-07 (issue 41), no server."""

from __future__ import annotations

import json

from flows.hero_report import print_summary
from flows.verdict import choices, gate_words, verdict_lines

# The demo's verify report, the parts the verdict reads (issue 41: c=1 draft k=2 16.8 tok/s x1.00
# vs n-gram k=2 20.4 tok/s x1.21, "gate passed, promoted")
DEMO = {
    "acceptance_length": 1.31,
    "ngram": {"acceptance_length_all_steps": 1.52},
    "serving": {
        "1": {
            "num_speculative_tokens": 2,
            "tokens_per_s": 16.8,
            "speedup": 1.0,
            "ngram": {"num_speculative_tokens": 2, "tokens_per_s": 20.4, "speedup": 1.21},
        },
        "8": {
            "num_speculative_tokens": 1,
            "tokens_per_s": 70.0,
            "speedup": 0.9,
            "ngram": {"num_speculative_tokens": 1, "tokens_per_s": 76.0, "speedup": 0.98},
        },
    },
    "gate": {
        "passed": True,
        "reasons": [],
        "checks": {
            "min_acceptance_length": 1.1,
            "max_regression": 0.05,
            "previous": None,
            "max_mismatch_fraction": 0.0,
            "require_beat_ngram": False,
            "beats_ngram": False,
        },
    },
}
TRAIN = {"samples": 40, "steps": 100, "epochs": 20}


def test_serve_the_fastest_per_concurrency():
    picks = choices(DEMO["serving"])
    assert [(p.concurrency, p.method, p.k) for p in picks] == [
        ("1", "n-gram", 2),
        ("8", "the target alone", None),  # both speculative methods below x1.00 there
    ]
    assert picks[1].tokens_per_s == 70.0 / 0.9


def test_demo_verdict_says_what_to_serve_why_and_what_wins():
    lines = verdict_lines(DEMO, TRAIN)
    assert lines[0] == (
        "serve on this machine: c=1: n-gram k=2 (20.4 tok/s, x1.21 the target alone; the draft "
        "k=2: 16.8 tok/s); c=8: the target alone (77.8 tok/s; the draft k=1: 70.0 tok/s)"
    )
    assert lines[1] == (
        "why the draft loses: it trained on 40 samples in 100 steps (20 epochs), the demo's size "
        "(enough to run every stage): its acceptance length 1.310 against n-gram's 1.520 over "
        "all steps does not pay for its own forward here"
    )
    assert lines[2] == (
        "for a draft that wins: python -m flows.hero_run -c configs/smollm2-sharegpt.yaml "
        "(extract and train on a GPU)"
    )
    assert "2.724-2.727 against n-gram's 1.942" in lines[3] and "one H100" in lines[3]
    assert len(lines) == 4


def test_a_winning_draft_gets_one_line():
    won = json.loads(json.dumps(DEMO))
    won["serving"]["1"] |= {"tokens_per_s": 30.0, "speedup": 1.8}
    won["serving"]["8"] |= {"tokens_per_s": 90.0, "speedup": 1.16}
    assert verdict_lines(won, TRAIN) == [
        "serve on this machine: c=1: draft k=2 (30.0 tok/s, x1.80 the target alone); "
        "c=8: draft k=1 (90.0 tok/s, x1.16 the target alone)"
    ]


def test_gate_words_match_what_it_checked():
    words = gate_words(DEMO["gate"], "runs/promoted/smollm2-cpu/drafts/x", 1.31)
    assert words.startswith("gate: passed its acceptance checks (acceptance length 1.310 >= 1.1")
    assert (
        "beating n-gram was not required (verify.require_beat_ngram: false) and it does not"
        in words
    )
    assert words.endswith("promoted to runs/promoted/smollm2-cpu/drafts/x")
    strict = {**DEMO["gate"], "checks": {**DEMO["gate"]["checks"], "require_beat_ngram": True}}
    assert "and beats the n-gram baseline;" in gate_words(strict, None, 2.6)
    failed = {"passed": False, "reasons": ["acceptance length 1.050 < minimum 1.1"]}
    assert gate_words(failed, None, 1.05) == (
        "gate FAILED (acceptance length 1.050 < minimum 1.1): not promoted"
    )


def test_print_summary_ends_with_the_verdict(tmp_path, capsys):
    """print_summary (what `make demo` prints) on a summary whose folders hold the report and
    the train manifest: the gate's words, then the acceptance length, then the verdict last."""
    train_dir, verify_dir = tmp_path / "train", tmp_path / "verify"
    train_dir.mkdir()
    verify_dir.mkdir()
    (train_dir / "manifest.json").write_text(
        json.dumps({"samples": 40, "steps": 100, "train_config": {"epochs": 20}})
    )
    (verify_dir / "report.json").write_text(json.dumps(DEMO))
    vinfo = {
        "acceptance_length": 1.31,
        "speedup": {"1": 1.0},
        "gate": DEMO["gate"],
        "promoted": "P",
    }
    summary = {
        "profile": "smollm2-cpu",
        "wall_s": 1.0,
        "smoke_chat": None,
        "acceptance_length": 1.31,
        "stages": {
            "train": {"status": "cached", "dir": str(train_dir), "info": {"steps": 7}},
            "verify": {"status": "ran", "dir": str(verify_dir), "info": vinfo},
        },
    }
    print_summary(summary)
    out = capsys.readouterr().out.splitlines()
    assert out[-4:] == verdict_lines(DEMO, TRAIN)  # the manifest's 100 steps, not the info's 7
    assert out[-5].startswith("acceptance length: 1.31")
    assert any(line.startswith("gate: passed its acceptance checks") for line in out)
    assert not any("gate passed" in line for line in out)


def test_the_verdict_and_the_report_name_parallel_drafting():
    """A serving entry whose draft won with parallel drafting (issue 40) is named so in the
    verdict and in report.md's "What to serve", next to the other way's best."""
    from eagle3.verify.report import _serving_lines

    won = json.loads(json.dumps(DEMO))
    won["serving"]["1"] |= {
        "method": "parallel",
        "num_speculative_tokens": 4,
        "tokens_per_s": 30.0,
        "speedup": 1.8,
        "speculative_config": {"method": "eagle3", "num_speculative_tokens": 4,
                               "parallel_drafting": True},
        "other_method": {"method": "sequential", "num_speculative_tokens": 2,
                         "tokens_per_s": 25.0},
    }  # fmt: skip
    line = verdict_lines(won, TRAIN)[0]
    assert line.startswith(
        "serve on this machine: c=1: draft (parallel drafting) k=4 (30.0 tok/s, x1.80"
    )
    assert "the draft k=1: 70.0 tok/s" in line  # c=8: the sequential draft lost to the target
    won["serving"]["8"]["speculative_config"] = {"method": "eagle3", "num_speculative_tokens": 1}
    md = "\n".join(_serving_lines(won))
    assert "concurrency 1: **parallel drafting, k = 4**" in md
    assert "sequential drafting at its best k = 2: 25.0 tok/s" in md
    assert '"parallel_drafting": true' in md
    assert "concurrency 8: **k = 1**" in md
