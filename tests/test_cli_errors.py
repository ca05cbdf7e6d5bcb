"""Every `eagle3` command's one-line failure starts `error:` (issue #30 item 9, issue 42: the test
used to try `run-stage` only). One failure a user can fix per command, through the CLI's entry
point (eagle3.cli.main: the same code as the console script, in this process: no interpreter
start per command); none starts a server or loads a model. A command added to the CLI without a
case here fails the test."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import CPU_PROFILE


def cases(tmp: Path) -> dict[str, tuple[list[str], str]]:
    """command -> (its arguments, the start of its one line)."""
    nope = ["--set", "target.model=embedded:nope"]
    unknown = "error: unknown embedded model 'nope'"
    missing = tmp / "missing"
    return {
        # a profile error is one line, then its fields, indented (docs/faults.md's table)
        "plan": (["--set", "generate.nope=1"], f"error: {CPU_PROFILE}: invalid configuration"),
        "preflight": (["--set", "train.epochs=-1"], f"error: {CPU_PROFILE}: invalid configuration"),
        "validate": (["--set", "vocab.nope=1"], f"error: {CPU_PROFILE}: invalid configuration"),
        "prepare-model": (nope, unknown),
        "serve": (nope, unknown),
        "generate": (["--base-url", "http://127.0.0.1:9", *nope], unknown),
        "profile-concurrency": (
            ["--base-url", "http://127.0.0.1:9", "--set", "generate.max_attempts=1"],
            "error: profile-concurrency got no answer (",
        ),
        "extract": (
            ["--generate-dir", str(missing)],
            f"error: extract: its generate folder {missing} does not exist",
        ),
        "vocab": (["--extract-dir", str(missing)], f"error: vocab: its extract folder {missing}"),
        "make-tiny-target": (["nope"], "error: unknown kind 'nope'"),
        "render-unit": (
            ["--speculative"],
            "error: a speculative unit needs verify.speculative_unit",
        ),
        "train": (["--extract-dir", str(missing)], f"error: train: its extract folder {missing}"),
        "verify": (["--draft", str(missing)], f"error: draft {missing}"),
        "estimate-acceptance": ([str(missing)], "error: no generated samples to score"),
        "run-stage": (["nope"], "error: unknown stage 'nope'"),
        "tensorboard": ([], f"error: {tmp / 'smollm2-cpu' / 'tensorboard'}: no TensorBoard runs"),
    }


def test_every_command_fails_in_one_line_starting_error(tmp_path, capsys):
    import typer.main

    from eagle3.cli import app, main

    table = cases(tmp_path)
    runs = ["--set", f"paths.runs_dir={tmp_path}"]
    assert set(table) == set(typer.main.get_command(app).commands), "a command without a case"
    for command, (args, start) in table.items():
        profile = [] if command == "make-tiny-target" else ["-c", str(CPU_PROFILE), *runs]
        with pytest.raises(SystemExit) as e:
            main([command, *args, *profile])
        err = capsys.readouterr().err
        first, *more = [ln for ln in err.splitlines() if ln.strip()] or [""]
        assert first.startswith(start) and "Traceback" not in err, (command, err)
        config = "invalid configuration" in first
        assert e.value.code == (2 if config else 1), (command, e.value.code, err)
        assert all(ln.startswith("  ") for ln in more) if config else not more, (command, err)
