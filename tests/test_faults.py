"""Faults and bad input (issue #16): no orphaned servers, no silent drops, no untrained draft
sealed, clear messages. Each test names the finding it covers; each failed before its fix.

Real parts: the session's vLLM server (tests/conftest.py), the SmolLM2 tokenizer and model, a
real tmpfs for the full disk. One test starts its own vLLM server (the SIGTERM of `eagle3
generate`, which must stop the server it started). Test double only where vLLM cannot be made
to misbehave: tests/fakes/scripted_server.py answers 200 with a non-JSON body and returns token
ids that are not its tokenizer's. The kill -9 resume test is tests/test_generate_vllm.py's; the
>= 20-kill trial is bench/faults.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eagle3.errors import (
    CorruptArtifact,
    EndpointError,
    MissingSamples,
    NoResult,
    TokenIdMismatch,
)
from eagle3.generate.prompts import sample_id
from eagle3.generate.runner import generate
from eagle3.generate.storage import ShardStore, iter_samples, latest_errors
from eagle3.serving.process import group_members
from eagle3.serving.readiness import free_port, probe, wait_until_ready
from tests import proctree
from tests.conftest import CPU_PROFILE, ROOT, gen_cfg


def write_prompts(path: Path, n: int) -> Path:
    path.write_text(
        "".join(
            json.dumps({"prompt": f"Name one fact about the number {i}."}) + "\n" for i in range(n)
        )
    )
    return path


def sample(i: int, prompt_ids: list[int], completion_ids: list[int]) -> dict:
    return {
        "id": f"s{i}",
        "messages": [{"role": "user", "content": f"q{i}"}],
        "prompt_token_ids": prompt_ids,
        "completion_token_ids": completion_ids,
        "flags": [],
    }


def write_generate_dir(root: Path, shards: list[list[bytes]], listed: int) -> Path:
    """A generate folder written by hand: shards of raw lines and a manifest that lists ``listed`` samples."""
    root.mkdir(parents=True, exist_ok=True)
    for k, lines in enumerate(shards):
        (root / f"samples-{k:05d}.jsonl").write_bytes(b"".join(lines))
    (root / "manifest.json").write_text(json.dumps({"totals": {"samples": listed}}))
    return root


def line(record: dict) -> bytes:
    return json.dumps(record).encode() + b"\n"


# --- finding 2: a corrupt line no longer ends the reading ------------------------------------


def test_readers_skip_a_bad_line_record_it_and_go_on(tmp_path):
    good = [line(sample(i, [1, 2], [3, 4])) for i in range(7)]
    root = write_generate_dir(
        tmp_path / "gen",
        [good[:1] + [b'{"id": "s9", "messa\n'] + good[1:4], good[4:] + [b'{"id": "cut']],
        listed=8,
    )
    bad: list[tuple[str, str]] = []
    ids = [
        s["id"]
        for s in iter_samples(root, on_bad=lambda where, reason: bad.append((where, reason)))
    ]
    assert ids == [f"s{i}" for i in range(7)], "every good sample after the bad line is read"
    assert [w for w, _ in bad] == [f"{root}/samples-00000.jsonl:2", f"{root}/samples-00001.jsonl:4"]
    assert "unreadable line" in bad[0][1] and "cut off" in bad[1][1]
    # generate's resume keeps the records after the bad line (it used to truncate the shard there)
    store = ShardStore(root)
    assert store.done_ids == {f"s{i}" for i in range(7)} and len(store.bad_lines) == 1
    store.close()
    assert len(list(iter_samples(root, on_bad=lambda *_: None))) == 7


def test_extract_records_bad_lines_refuses_foreign_ids_and_zero_samples(
    cpu_cfg, smol_model, tmp_path
):
    from transformers import AutoTokenizer

    from eagle3.extract.runner import extract

    tok = AutoTokenizer.from_pretrained(smol_model)
    ids = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    good = [line(sample(i, ids(f"Question {i}?"), ids(f"Answer {i}."))) for i in range(3)]
    foreign = line(sample(7, ids("Question?"), [5, 999_999]))  # an id past SmolLM2's 49152
    root = write_generate_dir(
        tmp_path / "gen", [good[:1] + [b"{not json\n"] + good[1:] + [foreign]], listed=5
    )
    cfg = gen_cfg(tmp_path, "extract.backend=hf")
    m = extract(cfg, root, tmp_path / "ext", str(smol_model))
    assert m["samples"] == 3 and m["this_run"]["unreadable"] == 1, (
        "all 3 good samples, none dropped silently"
    )
    reasons = [
        json.loads(x)["reason"]
        for x in (tmp_path / "ext" / "errors.jsonl").read_text().splitlines()
    ]
    assert any(r.startswith(f"{root}/samples-00000.jsonl:2: unreadable line") for r in reasons), (
        reasons
    )
    assert any(
        "token id 999999 outside the target's vocabulary (target.vocab_size 49152)" in r
        for r in reasons
    )
    # a shard gone missing: the manifest lists more than is there and nothing says why
    (root / "samples-00000.jsonl").write_bytes(b"".join(good[:2]))
    with pytest.raises(MissingSamples, match=r"manifest.json lists 5 samples, the shards hold 2"):
        extract(cfg, root, tmp_path / "ext2", str(smol_model))
    # nothing usable at all: the stage fails instead of sealing an empty result
    only_foreign = write_generate_dir(tmp_path / "gen3", [[foreign]], listed=1)
    with pytest.raises(NoResult, match=r"extract stored 0 samples .*errors.jsonl"):
        extract(cfg, only_foreign, tmp_path / "ext3", str(smol_model))
    assert not (tmp_path / "ext3" / "manifest.json").exists()


# --- finding 3: an untrained draft is not exported or sealed ----------------------------------


def test_train_without_a_finite_step_fails_and_exports_nothing(tmp_path):
    from eagle3.train import TrainingDiverged, train
    from tests.test_train import make_cfg, make_data, make_target, make_vocab

    target, embed = make_target(tmp_path / "target")
    data = make_data(
        tmp_path / "extract", embed, n=8, nan_ids=(3,)
    )  # one NaN sample: one batch per epoch
    vocab = make_vocab(data, tmp_path / "vocab.safetensors")
    with pytest.raises(
        TrainingDiverged, match=r"only 0 of 2 optimizer steps were finite.*nothing was exported"
    ):
        train(make_cfg(epochs=2, token_budget=1024), data, vocab, target, tmp_path / "train")
    assert (
        not (tmp_path / "train" / "manifest.json").exists()
        and not (tmp_path / "train" / "vllm-draft").exists()
    )


def test_a_truncated_shard_is_named(tmp_path):
    from eagle3.extract.storage import HiddenStateDataset, ShardWriter
    from tests.test_train import make_data, make_target

    _, embed = make_target(tmp_path / "target")
    data = make_data(tmp_path / "extract", embed, n=16)
    shard = data / "hidden-00001.safetensors"
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    for open_it in (lambda: HiddenStateDataset(data), lambda: ShardWriter(data)):
        with pytest.raises(
            CorruptArtifact, match=rf"{shard}: truncated safetensors shard .*rerun extract"
        ):
            open_it()


def test_vocab_fails_when_a_shard_is_missing(tmp_path):
    from eagle3.vocab import vocab_stage
    from tests.test_train import make_data, make_target

    _, embed = make_target(tmp_path / "target")
    data = make_data(tmp_path / "extract", embed, n=16)
    (data / "manifest.json").write_text(json.dumps({"samples": 16}))
    (data / "hidden-00001.safetensors").unlink()
    with pytest.raises(MissingSamples, match=r"manifest.json lists 16 samples, its shards hold 8"):
        vocab_stage(data, tmp_path / "vocab", 512, 80)


# --- findings 4 and 5: wrong URLs stop the run at once; /v1 is accepted -------------------------


@pytest.mark.vllm
def test_readiness_accepts_v1_and_fails_fast_on_404(vllm_server):
    base = vllm_server.base_url
    wait_until_ready(
        f"{base}/v1/",
        vllm_server.model,
        timeout_s=10,
        poll_interval_s=0.5,
        check_alive=lambda: None,
    )
    # a 404 is not waited out: that would end in a ServerTimeoutError (after 30 s), not this
    with pytest.raises(EndpointError, match=rf"{base}/wrong/health answered 404"):
        wait_until_ready(
            f"{base}/wrong",
            vllm_server.model,
            timeout_s=30,
            poll_interval_s=1,
            check_alive=lambda: None,
        )
    assert probe(f"{base}/v1", vllm_server.model) is None


@pytest.mark.vllm
def test_a_wrong_url_is_fatal_and_a_rerun_redoes_what_it_poisoned(vllm_server, tmp_path):
    data = write_prompts(tmp_path / "p.jsonl", 3)
    cfg = gen_cfg(tmp_path, f"generate.dataset={data}", "generate.max_tokens=8")
    out = tmp_path / "gen"
    with pytest.raises(
        EndpointError, match=rf"{vllm_server.base_url}/wrong/v1/models answered 404: check the URL"
    ):
        generate(cfg, [f"{vllm_server.base_url}/wrong"], out)
    with pytest.raises(EndpointError, match=r"does not list 'nope'.*target.served_model_name"):
        generate(
            gen_cfg(tmp_path, f"generate.dataset={data}", "target.served_model_name=nope"),
            [vllm_server.base_url],
            out,
        )
    assert not list(iter_samples(out)) and not latest_errors(out), (
        "no prompt was charged with the wrong URL"
    )
    # a folder poisoned before the fix: a 404 recorded as one prompt's permanent rejection
    poisoned = sample_id([{"role": "user", "content": "Name one fact about the number 1."}])
    out.mkdir()
    (out / "errors.jsonl").write_text(
        json.dumps(
            {
                "id": poisoned,
                "source": "line 2",
                "kind": "rejected",
                "reason": "rejected by server (404): Not Found",
            }
        )
        + "\n"
    )
    m = generate(cfg, [f"{vllm_server.base_url}/v1"], out)  # the fixed URL, in the OpenAI form
    assert m["totals"]["samples"] == 3 and "previously_rejected" not in m["this_run"]["counts"]
    assert m["totals"]["errors_by_kind"] == {}


def test_404_from_the_completions_endpoint_is_fatal(scripted, tmp_path):
    data = write_prompts(tmp_path / "p.jsonl", 4)
    cfg = gen_cfg(
        tmp_path,
        f"generate.dataset={data}",
        "target.served_model_name=zero",
        "generate.concurrency=1",
    )
    url = scripted("404")
    with pytest.raises(EndpointError, match=rf"{url}/v1/chat/completions answered 404"):
        generate(cfg, [url], tmp_path / "gen")
    assert not latest_errors(tmp_path / "gen")


# --- finding 6d, 8: a non-JSON 200 is a recorded failure; filled-in failures are not counted ----


def test_a_non_json_200_is_recorded_and_a_filled_in_failure_stops_counting(scripted, tmp_path):
    data = write_prompts(tmp_path / "p.jsonl", 3)
    cfg = gen_cfg(
        tmp_path,
        f"generate.dataset={data}",
        "target.served_model_name=zero",
        "generate.concurrency=1",
    )
    url = scripted("299")
    # the scripted server's canned ids are nobody's: this test is about the body, not the ids
    m = generate(cfg, [url], tmp_path / "gen", token_check=False)
    (failed,) = latest_errors(tmp_path / "gen").values()
    assert (
        failed["kind"] == "failed"
        and "answered 200 with a body that is not JSON" in failed["reason"]
    )
    assert m["totals"]["samples"] == 2 and m["totals"]["errors_by_kind"] == {"failed": 1}
    m = generate(cfg, [url], tmp_path / "gen", token_check=False)  # the rerun fills it in
    assert m["totals"]["samples"] == 3 and m["totals"]["errors_by_kind"] == {}


# --- finding 7: token ids are checked against the local tokenizer -------------------------------


def test_ids_that_are_not_the_local_tokenizers_stop_generate(scripted, smol_model, tmp_path):
    data = write_prompts(tmp_path / "p.jsonl", 3)
    cfg = gen_cfg(
        tmp_path,
        f"generate.dataset={data}",
        "target.served_model_name=zero",
        "generate.concurrency=1",
    )
    with pytest.raises(
        TokenIdMismatch,
        match=r"differ from the local tokenizer .* at position 0.*nothing of this "
        r"sample was stored",
    ):
        generate(cfg, [scripted("200")], tmp_path / "gen", tokenizer_path=str(smol_model))
    assert not list(iter_samples(tmp_path / "gen"))


# --- finding 6a/6b: one-line messages (no traceback), disk full -----------------------------------


def test_cli_prints_one_line_and_debug_shows_the_traceback(tmp_path):
    bad = tmp_path / "prompts.json"
    bad.write_text('[{"prompt": "a"}, {"prompt": ')
    argv = [
        sys.executable,
        "-m",
        "eagle3.cli",
        "generate",
        "-c",
        str(CPU_PROFILE),
        "--base-url",
        f"http://127.0.0.1:{free_port()}",
        "--out",
        str(tmp_path / "gen"),
        "--set",
        f"generate.dataset={bad}",
    ]
    r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert (
        f"error: dataset file {bad} cannot be read as json" in r.stderr
        and "convert it to .jsonl" in r.stderr
    )
    r = subprocess.run([*argv, "--debug"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "Traceback" in r.stderr and "InputDataError" in r.stderr


def whole_records(root: Path) -> list[str]:
    """The sample ids of a generate folder, asserting that every byte of every shard (the open one
    included) is a whole sample record: ``iter_samples`` alone skips an open shard's torn tail and
    only reports bad lines, so it cannot see a half-written record."""
    bad: list = []
    ids = [s["id"] for s in iter_samples(root, on_bad=lambda *b: bad.append(b))]
    assert not bad, bad
    for shard in sorted(root.glob("samples-*.jsonl*")):
        raw = shard.read_bytes()
        assert not raw or raw.endswith(b"\n"), f"{shard}: a torn record at its end: {raw[-80:]!r}"
    return ids


@pytest.mark.vllm
def test_disk_full_says_what_is_needed_and_a_rerun_resumes(vllm_server, tmp_path):
    """Through the CLI (docs/faults.md, issue #30 item 3): the one `error: disk full` line, exit 1,
    no task traceback; no torn record; a rerun after freeing space resumes."""
    small = tmp_path / "small"
    small.mkdir()
    # two pages: the writer lock's (eagle3/writer_lock.py) and one for the samples
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8k", "tmpfs", str(small)], capture_output=True
    ).returncode:
        pytest.skip("cannot mount a tmpfs here (not root)")
    try:
        data = write_prompts(tmp_path / "p.jsonl", 12)
        over = [f"generate.dataset={data}", "generate.concurrency=4", "generate.max_tokens=16"]
        r = subprocess.run(
            [sys.executable, "-m", "eagle3.cli", "generate", "-c", str(CPU_PROFILE),
             "--base-url", vllm_server.base_url, "--out", str(small / "gen"),
             *(a for o in over for a in ("--set", o))],
            cwd=ROOT, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        err = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith("generate ")]
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        assert "never retrieved" not in r.stderr and len(err) == 1, r.stderr
        assert re.match(
            r"error: disk full writing .*: about \d.* more is needed .* rerun the same command",
            err[0],
        ), err
        before = whole_records(small / "gen")
        assert 0 < len(before) < 12
        subprocess.run(["mount", "-o", "remount,size=4m", str(small)], check=True)
        m = generate(gen_cfg(tmp_path, *over), [vllm_server.base_url], small / "gen")
        after = whole_records(small / "gen")
        assert len(after) == len(set(after)) == 12 and set(before) <= set(after)
        assert m["this_run"]["resumed_from"] == len(before) and m["totals"]["errors_by_kind"] == {}
    finally:
        subprocess.run(["umount", str(small)], check=False)


# --- findings 1 and 8: SIGTERM stops the server this command started and says what was saved ----


def _pids_with_arg(*args: str) -> list[int]:
    needle = "\0".join(args).encode()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if needle in Path(f"/proc/{entry}/cmdline").read_bytes():
                    found.append(int(entry))
            except OSError:
                pass
    return found


def sigterm_when(
    argv: list[str], ready, timeout_s: float, what: str, sig: int = signal.SIGTERM
) -> tuple[int, str, set[int]]:
    """Run a CLI command in a session of its own, send it ``sig`` once ``ready()`` holds with a
    server of its own up; (exit code, stderr, the sessions of the command and every server it had
    started: tests/proctree.py)."""
    proc = subprocess.Popen(
        argv,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    sessions: set[int] = set()
    try:
        deadline = time.monotonic() + timeout_s
        while proc.poll() is None and not ready() and time.monotonic() < deadline:
            time.sleep(0.2)
        sessions = proctree.sessions(proc.pid)
        if proc.poll() is not None or not proctree.sessions(proc.pid, own=False):
            proc.kill()
            pytest.fail(f"{what}; exit {proc.poll()}:\n{proc.communicate()[1][-3000:]}")
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, err, sessions


def test_a_server_dies_with_its_parent_after_kill_9(tmp_path):
    """kill -9 runs no cleanup at all: the child asked Linux for SIGTERM when its parent dies.
    (A real vLLM server is covered by the SIGTERM test; `sleep` stands in for its process here.)"""
    code = (
        "import sys, time; from eagle3.serving.process import ChildProcess; "
        f"c = ChildProcess(['sleep', '300'], '{tmp_path}/child.log'); print(c.pid, flush=True); time.sleep(300)"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    child = int(parent.stdout.readline())
    assert group_members(child)
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while group_members(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not group_members(child), "the child outlived its kill -9'd parent"


@pytest.mark.vllm
@pytest.mark.slow
def test_sigterm_stops_the_started_server_and_says_how_to_resume(smol_model, tmp_path):
    port = free_port()
    out = tmp_path / "gen"
    data = write_prompts(tmp_path / "p.jsonl", 200)
    argv = [
        sys.executable,
        "-m",
        "eagle3.cli",
        "generate",
        "-c",
        str(CPU_PROFILE),
        "--out",
        str(out),
        "--set",
        f"paths.runs_dir={tmp_path / 'runs'}",
        "--set",
        f"serve.port={port}",
        "--set",
        f"generate.dataset={data}",
        "--set",
        "generate.max_tokens=16",
        "--set",
        "generate.concurrency=4",
    ]
    midrun = lambda: out.exists() and sum(1 for _ in iter_samples(out, on_bad=lambda *_: None)) >= 3  # noqa: E731
    returncode, err, sessions = sigterm_when(
        argv, midrun, 300, "generate must be mid-run with its server up"
    )
    saved = len(whole_records(out))
    assert returncode == 128 + signal.SIGTERM, err
    assert (
        f"interrupted (SIGTERM): every server this command started was stopped; {saved} samples are saved in "
        f"{out}. Rerun the same command to resume."
    ) in " ".join(err.split()), err
    left = proctree.wait_gone(sessions, 10)
    assert not left, f"left by the command or its server:\n{proctree.describe(left)}"
