"""Issue #39: one writer per folder, every input checked before a server starts, no traceback for
a user's mistake. One test per class (docs/faults.md, "Issue #39").

Real parts: the `eagle3` command as a user runs it, the session's vLLM server (tests/conftest.py)
for the two generate commands at once, the SmolLM2 model for train and verify's checks, a
read-only tmpfs. No test starts a vLLM server of its own: every check here runs before one would.
Test double: tests/fakes/scripted_server.py for the empty completion (status 298) and the
duplicated folder, where what is under test is the store, not the server's answers.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eagle3.errors import FolderBusy, NoResult
from eagle3.generate.runner import generate
from eagle3.generate.storage import iter_samples, latest_errors
from eagle3.writer_lock import LOCK_NAME, writer_lock
from tests.conftest import CPU_PROFILE, ROOT, gen_cfg
from tests.test_faults import write_prompts


def cli(*args: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "eagle3.cli", *args]
    return subprocess.run(
        argv,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def one_error_line(r: subprocess.CompletedProcess) -> str:
    """The command failed with exit 1 and printed one ``error:`` line, no traceback."""
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, r.stderr
    return errors[0]


def gen_args(out: Path, dataset: str | Path, *sets: str) -> list[str]:
    args = ["generate", "-c", str(CPU_PROFILE), "--out", str(out)]
    for s in (f"generate.dataset={dataset}", *sets):
        args += ["--set", s]
    return args


# --- two writers at once ------------------------------------------------------------------------


@pytest.mark.vllm
def test_two_generate_commands_on_one_folder_the_second_fails_at_once(vllm_server, tmp_path):
    """Before: 250 records for 200 prompts, one run sealed, the other died with 'I/O operation
    on closed file'. Now the second fails within seconds naming the first; the first ends whole."""
    data = write_prompts(tmp_path / "p.jsonl", 24)
    out = tmp_path / "gen"
    args = gen_args(out, data, "generate.max_tokens=16", "generate.concurrency=4")
    args += ["--base-url", vllm_server.base_url]
    argv = [sys.executable, "-m", "eagle3.cli", *args]
    first = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    lock = out / LOCK_NAME
    deadline = time.monotonic() + 60
    while not (lock.is_file() and lock.read_text().strip()):
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()
        time.sleep(0.05)
    # the first stopped (SIGSTOP) while it holds the folder: the second can only fail at once, as
    # waiting for the first would never end (cli's timeout), and the first cannot finish meanwhile
    first.send_signal(signal.SIGSTOP)
    try:
        second = cli(*args, timeout=120)
    finally:
        first.send_signal(signal.SIGCONT)
    line = one_error_line(second)
    assert f"{out} is being written by another generate run: pid {first.pid} on " in line
    assert f"generate -c {CPU_PROFILE} --out {out}" in line and "wait for it to finish" in line
    assert first.wait(timeout=240) == 0, first.communicate()
    ids = [s["id"] for s in iter_samples(out)]
    assert len(ids) == len(set(ids)) == 24, "every sample once"
    assert json.loads((out / "artifact.json").read_text())["result"]["samples"] == 24
    assert lock.read_text() == "", "released: the lock file is emptied"


def test_a_killed_holders_lock_is_taken_over_and_a_thread_cannot_share_it(tmp_path, caplog):
    out = tmp_path / "gen"
    code = (
        "import sys, time\nfrom eagle3.writer_lock import writer_lock\n"
        "with writer_lock(sys.argv[1], 'extract'):\n    print('held', flush=True)\n"
        "    time.sleep(60)\n"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code, str(out)], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(FolderBusy, match=rf"another train run: pid {holder.pid} on "):
        with writer_lock(out, "train"):
            pass
    holder.kill()  # kill -9: no cleanup runs, the kernel drops the lock
    holder.wait()
    with writer_lock(out, "train"):
        assert f"took over the writer lock of pid {holder.pid}" in caplog.text
        with writer_lock(out, "train"):  # re-entrant in the thread that holds it
            pass
        import threading

        seen: list[BaseException] = []
        t = threading.Thread(target=lambda: _try_lock(out, seen))
        t.start()
        t.join()
        assert seen and isinstance(seen[0], FolderBusy), seen


def _try_lock(out: Path, seen: list[BaseException]) -> None:
    try:
        with writer_lock(out, "train"):
            pass
    except BaseException as e:  # noqa: BLE001 - the test reads it
        seen.append(e)


def test_a_folder_damaged_by_two_writers_is_repaired_by_a_rerun(scripted, tmp_path):
    """A folder with every record twice (what two writers left), sealed: a rerun drops the
    duplicates, requests nothing twice and the manifest counts each sample once."""
    data = write_prompts(tmp_path / "p.jsonl", 6)
    sets = [f"generate.dataset={data}", "target.served_model_name=zero", "generate.concurrency=1"]
    cfg = gen_cfg(tmp_path, *sets)
    out = tmp_path / "gen"
    url = scripted("200")
    generate(cfg, [url], out, token_check=False)
    shard = next(out.glob("samples-*.jsonl"))
    (out / "samples-00001.jsonl").write_bytes(shard.read_bytes())  # the second writer's copy
    assert len(list(iter_samples(out))) == 12
    m = generate(cfg, [url], out, token_check=False)
    assert m["this_run"]["counts"]["dropped_duplicates"] == 6
    assert "generated" not in m["this_run"]["counts"], "nothing requested again"
    ids = [s["id"] for s in iter_samples(out)]
    assert len(ids) == len(set(ids)) == 6 and m["totals"]["samples"] == 6


# --- bad inputs: one line, exit 1, nothing created, no server -----------------------------------


def test_bad_output_folders_are_one_line_and_leave_nothing(tmp_path):
    data = write_prompts(tmp_path / "p.jsonl", 2)
    afile = tmp_path / "afile"
    afile.write_text("keep me")
    line = one_error_line(cli(*gen_args(afile, data)))
    assert f"output folder {afile} is an existing file, not a folder" in line
    assert afile.read_text() == "keep me"
    ro = tmp_path / "ro"
    ro.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(ro)], capture_output=True
    ).returncode:
        pytest.skip("cannot mount a read-only tmpfs here (not root)")
    try:
        line = one_error_line(cli(*gen_args(ro / "gen", data)))
        assert f"cannot write the output folder {ro / 'gen'} ({ro}: read-only file system)" in line
        assert "choose a writable place" in line
    finally:
        subprocess.run(["umount", str(ro)], check=True)


@pytest.mark.parametrize(
    "case",
    ["empty", "csv", "bare-name", "no-usable-row"],
)
def test_bad_datasets_fail_before_any_server_and_say_what_to_do(case, tmp_path):
    files = {
        "empty": ("p.jsonl", ""),
        "csv": ("p.csv", "prompt\nhello\n"),
        "no-usable-row": ("p.jsonl", '{"text": "no prompt column"}\n'),
    }
    if case == "bare-name":
        dataset: str | Path = "prompts"
    else:
        name, text = files[case]
        dataset = tmp_path / name
        dataset.write_text(text)
    out, runs = tmp_path / "gen", tmp_path / "runs"
    line = one_error_line(cli(*gen_args(out, dataset, f"paths.runs_dir={runs}")))
    assert not list(runs.rglob("vllm-*.log")), "no server was started"
    expected = {
        "empty": f"dataset {dataset} holds no rows (an empty file?)",
        "csv": f"dataset file {dataset}: unsupported type '.csv'; generate reads .jsonl, .json or "
        ".parquet",
        "bare-name": "dataset file prompts not found (generate.dataset is neither a file here "
        "nor a hub dataset id owner/name)",
        "no-usable-row": f"dataset {dataset}: none of its 1 rows is a usable prompt (1 unreadable",
    }[case]
    assert expected in line, line
    assert not out.exists(), "nothing written"


def test_a_hub_id_target_without_network_fails_at_once_naming_the_file(tmp_path):
    """Before: 50 s of retries, then exit 0 with a sealed folder the next stage refused."""
    data = write_prompts(tmp_path / "p.jsonl", 2)
    out = tmp_path / "gen"
    offline = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    runs = tmp_path / "runs"
    r = cli(
        *gen_args(out, data, "target.model=someorg/some-model", f"paths.runs_dir={runs}"),
        env=offline,
    )
    line = one_error_line(r)
    assert not list(runs.rglob("vllm-*.log")), "no server was started"
    assert (
        "target.model someorg/some-model: config.json is not in the local Hugging Face cache"
        in (line)
    )
    assert "HF_HUB_OFFLINE is set" in line and "huggingface-cli download someorg/some-model" in line
    assert not out.exists()
    ext = tmp_path / "ext"
    r = cli(
        "extract", "-c", str(CPU_PROFILE), "--generate-dir", str(out), "--out", str(ext),
        "--set", "target.model=someorg/some-model", env=offline,
    )  # fmt: skip
    assert "config.json is not in the local Hugging Face cache" in one_error_line(r)
    assert not ext.exists()


def _vocab(path: Path, rows: int, vocab_size: int = 49152, **meta: str) -> Path:
    import torch

    from eagle3.vocab import build_vocab, save_vocab

    counts = torch.arange(vocab_size, 0, -1, dtype=torch.int64)
    save_vocab(build_vocab(counts, rows), path, meta)
    return path


def test_train_refuses_a_vocab_file_that_does_not_fit(cpu_cfg, smol_model, tmp_path):
    """Before: a random file was a traceback; a 512-row vocab where the profile says 8192, built
    from another extract, trained without a word. The command once (a random file), the other
    cases through run_stage, the path the command and the flow share."""
    from eagle3.errors import InputDataError
    from eagle3.stages import run_stage

    ext = tmp_path / "ext"
    ext.mkdir()
    (ext / "artifact.json").write_text(json.dumps({"key": "k", "result": {"tokens_key": "A"}}))
    (ext / "index.json").write_text("{}")
    out = tmp_path / "train"
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(os.urandom(256))
    args = ["train", "-c", str(CPU_PROFILE), "--extract-dir", str(ext), "--out", str(out)]
    line = one_error_line(cli(*args, "--vocab-file", str(junk)))
    assert f"{junk} is not a vocab file written by `eagle3 vocab`" in line

    def train(vocab: Path) -> str:
        with pytest.raises(InputDataError) as e:
            run_stage(
                cpu_cfg, "train", {"extract": ext, "vocab": tmp_path}, out,
                model=str(smol_model), options={"vocab_file": vocab},
            )  # fmt: skip
        return str(e.value)

    small = _vocab(tmp_path / "small.safetensors", 512, extract_tokens_key="A")
    assert (
        f"{small} has 512 draft rows, the profile's vocab.draft_vocab_size is 8192: rerun "
        "`eagle3 vocab` on this extract" in train(small)
    )
    other = _vocab(tmp_path / "other.safetensors", 8192, extract_tokens_key="B")
    assert f"{other} was built from another extract (tokens B) than {ext} (tokens A)" in (
        train(other)
    )
    tok = _vocab(tmp_path / "tok.safetensors", 8192, vocab_size=50000, extract_tokens_key="A")
    assert "maps a target vocabulary of 50000 ids, the profile's target.vocab_size is 49152" in (
        train(tok)
    )
    assert not out.exists(), "nothing written"


def test_verify_refuses_a_draft_folder_it_cannot_load_before_any_server(smol_model, tmp_path):
    draft = tmp_path / "vllm-draft"
    draft.mkdir()
    (draft / "config.json").write_text('{"architectures": ["LlamaForCausalLMEagle3"]}')
    (draft / "model.safetensors").write_bytes(b"not safetensors")
    out, runs = tmp_path / "verify", tmp_path / "runs"
    args = ["verify", "-c", str(CPU_PROFILE), "--draft", str(draft), "--out", str(out)]
    line = one_error_line(cli(*args, "--set", f"paths.runs_dir={runs}"))
    assert not list(runs.rglob("vllm-*.log")), "no server was started"
    assert f"draft {draft}: model.safetensors is not a readable safetensors file" in line
    assert not out.exists()


def test_missing_input_folders_are_named_with_the_option_to_fix_them(tmp_path):
    """Before: extract said ``[Errno 2] No such file or directory: '.../manifest.json'``; vocab
    said "no loss-carrying tokens were counted"."""
    nope = tmp_path / "nope"
    half = tmp_path / "half"  # a generate folder whose run never finished
    half.mkdir()
    (half / "samples-00000.jsonl.open").write_text("")
    c = ["-c", str(CPU_PROFILE)]
    r = cli("extract", *c, "--generate-dir", str(nope), "--out", str(tmp_path / "x"))
    assert (
        f"extract: its generate folder {nope} does not exist: run `eagle3 generate` first, or "
        "name the folder with --generate-dir" in one_error_line(r)
    )
    r = cli("extract", *c, "--generate-dir", str(half), "--out", str(tmp_path / "x"))
    assert f"extract: {half} has no manifest.json: generate did not finish there" in (
        one_error_line(r)
    )
    r = cli("vocab", *c, "--extract-dir", str(nope), "--out", str(tmp_path / "v"))
    assert f"vocab: its extract folder {nope} does not exist" in one_error_line(r)
    assert not (tmp_path / "x").exists() and not (tmp_path / "v").exists()


# --- a completion with no token ------------------------------------------------------------------


def test_an_empty_completion_is_an_error_and_requested_again(scripted, tmp_path):
    """vLLM cannot cheaply be made to answer with no token: the scripted server's status 298
    answers finish_reason 'length', empty text, ``token_ids: []`` (what the issue saw)."""
    data = write_prompts(tmp_path / "p.jsonl", 3)
    sets = [f"generate.dataset={data}", "target.served_model_name=zero", "generate.concurrency=1"]
    cfg = gen_cfg(tmp_path, *sets)
    out = tmp_path / "gen"
    m = generate(cfg, [scripted("298")], out, token_check=False)
    assert m["totals"]["samples"] == 2 and m["totals"]["errors_by_kind"] == {"failed": 1}
    assert m["this_run"]["counts"]["empty_completion"] == 1
    (err,) = latest_errors(out).values()
    assert err["reason"].startswith(
        "empty completion: the server returned no token (finish_reason 'length'"
    )
    m = generate(cfg, [scripted("200")], out, token_check=False)  # the rerun asks for it again
    assert m["this_run"]["counts"]["generated"] == 1 and m["totals"]["samples"] == 3
    assert m["totals"]["errors_by_kind"] == {}
    # every answer empty: nothing stored, nothing sealed, one line
    empty = tmp_path / "all-empty"
    with pytest.raises(NoResult, match="generate stored 0 samples"):
        generate(cfg, [scripted("298,298,298")], empty, token_check=False)
    assert not (empty / "artifact.json").exists() and not (empty / "manifest.json").exists()


def test_an_empty_record_stored_by_an_older_run_is_dropped_and_requested_again(scripted, tmp_path):
    data = write_prompts(tmp_path / "p.jsonl", 3)
    sets = [f"generate.dataset={data}", "target.served_model_name=zero", "generate.concurrency=1"]
    cfg = gen_cfg(tmp_path, *sets)
    out = tmp_path / "gen"
    generate(cfg, [scripted("200")], out, token_check=False)
    shard = next(out.glob("samples-*.jsonl"))
    lines = shard.read_bytes().splitlines(keepends=True)
    old = json.loads(lines[0])
    old["completion_token_ids"], old["content"] = [], ""
    shard.write_bytes(json.dumps(old).encode() + b"\n" + b"".join(lines[1:]))
    m = generate(cfg, [scripted("200")], out, token_check=False)
    assert m["this_run"]["counts"]["dropped_empty_completions"] == 1
    assert m["this_run"]["counts"]["generated"] == 1
    assert all(s["completion_token_ids"] for s in iter_samples(out)) and m["totals"]["samples"] == 3


def test_a_second_hero_run_of_a_profile_waits_and_says_for_whom(tmp_path):
    """The nightly regeneration and a run started from the UI share the profile's folders: the
    second waits (queues) and its log, on its run page in the UI, names the first. The helper
    the flow wraps its stages in, without a Prefect server (tests/test_cancel.py runs the flow)."""
    import threading

    from flows.stage_folders import one_run_per_profile

    cfg = gen_cfg(tmp_path)
    code = (  # holds the folder until told to let go (a line on its stdin)
        "import sys\nfrom eagle3.writer_lock import writer_lock\n"
        "with writer_lock(sys.argv[1], 'hero'):\n    print('held', flush=True)\n"
        "    sys.stdin.readline()\n"
    )
    first = subprocess.Popen(
        [sys.executable, "-c", code, str(cfg.paths.run_dir)],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert first.stdout.readline().strip() == "held"
    said: list[str] = []
    released = threading.Event()
    entered: list[bool] = []  # whether the first had been told to let go when the second entered

    def second() -> None:
        with one_run_per_profile(cfg, log=said.append, poll_s=0.1):
            entered.append(released.is_set())

    t = threading.Thread(target=second)
    t.start()
    deadline = time.monotonic() + 60
    while not said and t.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)  # until the second says it waits
    released.set()
    first.communicate("go\n", timeout=30)
    t.join(timeout=60)
    assert first.returncode == 0
    assert entered == [True], "the second run started only when the first had released the folder"
    assert said[0].startswith(
        f"waiting: {cfg.paths.run_dir} is being written by another hero run: pid {first.pid} on "
    )
    assert "this run starts when that one ends" in said[0] and "is free after" in said[-1]


def test_a_wait_for_a_server_says_what_it_waits_for(monkeypatch, caplog):
    """A wrong serve.base_url (nothing listens there) is not a silent wait of
    serve.ready_timeout_s: the wait for a server started elsewhere says every SAY_EVERY_S what it
    waits for and why; one started here (loading) is waited for quietly (its death is caught)."""
    import logging

    from eagle3.serving import readiness

    monkeypatch.setattr(readiness, "SAY_EVERY_S", 0.2)

    def said(say: bool) -> list[str]:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=readiness.__name__):
            with pytest.raises(readiness.ServerTimeoutError, match="not ready after"):
                readiness.wait_until_ready(
                    "http://127.0.0.1:9",
                    "m",
                    timeout_s=0.7,
                    poll_interval_s=0.05,
                    check_alive=lambda: None,
                    say_waiting=say,
                )
        return [
            r.getMessage() for r in caplog.records if "waiting for the server" in r.getMessage()
        ]

    lines = said(True)
    assert len(lines) >= 2 and "http://127.0.0.1:9" in lines[0] and "refused" in lines[0]
    assert said(False) == []
