"""Ctrl-C and kill -9 on real commands (issue 42; the claims of docs/faults.md, "Stopping").

SIGINT (Ctrl-C) to `eagle3 generate` and `eagle3 train` ends with exit 130, the one `interrupted
(SIGINT)` line, no process of the command left (by session: tests/proctree.py), and state that
a rerun resumes: generate's whole records (the rerun requests only the rest), train's last
checkpoint (the rerun continues from its step). kill -9 of `eagle3 extract` after its first shard:
a rerun keeps the shards written and extracts only the rest. (SIGINT to verify:
tests/test_cancel.py; kill -9 of a hero run that started its own vLLM server:
tests/test_deployments.py; kill -9 of generate: tests/test_generate_vllm.py.)

Every command runs as a real process of the `eagle3` CLI on tiny data; the signal is sent once a
file the run writes shows it mid-run (a sample, a checkpoint, a shard), never after a sleep. The
reruns call the library function the command runs (no second interpreter start).
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import proctree
from tests.conftest import CPU_PROFILE, GENERATED, ROOT, gen_cfg
from tests.test_faults import whole_records, write_prompts


def start(argv: list[str], log: Path) -> subprocess.Popen:
    """An `eagle3` command in a session of its own, its output in ``log`` (a pipe nobody reads
    could fill and stop it)."""
    with open(log, "wb") as f:
        return subprocess.Popen(
            [sys.executable, "-m", "eagle3.cli", *argv],
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def wait_for(proc: subprocess.Popen, log: Path, what: str, ready, timeout_s: float = 240) -> None:
    """Until ``ready()`` holds; fail if the command ends first or it takes over ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        if proc.poll() is not None:
            pytest.fail(f"{what}: the command ended first ({proc.returncode}):\n{log.read_text()}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"{what}: not within {timeout_s} s:\n{log.read_text()[-3000:]}")
        time.sleep(0.05)


def interrupt(proc: subprocess.Popen, log: Path, sig: int) -> tuple[str, set[int]]:
    """Send ``sig``; (the command's output, the sessions of it and of what it had started)."""
    sessions = proctree.sessions(proc.pid)
    proc.send_signal(sig)
    try:
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return " ".join(log.read_text().split()), sessions


def sets(overrides: list[str]) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


@pytest.mark.vllm
def test_sigint_of_generate_exits_130_and_a_rerun_resumes(vllm_server, tmp_path):
    out, log = tmp_path / "gen", tmp_path / "generate.log"
    data = write_prompts(tmp_path / "p.jsonl", 24)
    over = [f"generate.dataset={data}", "generate.max_tokens=16", "generate.concurrency=4"]
    argv = ["generate", "-c", str(CPU_PROFILE), "--base-url", vllm_server.base_url]
    proc = start([*argv, "--out", str(out), *sets(over)], log)
    wait_for(proc, log, "two samples saved", lambda: out.exists() and len(_ids(out)) >= 2)
    text, sessions = interrupt(proc, log, signal.SIGINT)
    saved = whole_records(out)
    assert proc.returncode == 128 + signal.SIGINT == 130, text
    assert (
        f"interrupted (SIGINT): every server this command started was stopped; {len(saved)} "
        f"samples are saved in {out}. Rerun the same command to resume."
    ) in text, text
    assert "Traceback" not in text and 2 <= len(saved) < 24, text
    left = proctree.wait_gone(sessions, 30)
    assert not left, proctree.describe(left)
    from eagle3.generate.runner import generate

    m = generate(gen_cfg(tmp_path, *over), [vllm_server.base_url], out)
    after = whole_records(out)
    assert len(after) == len(set(after)) == 24 and set(saved) <= set(after)
    assert m["this_run"]["resumed_from"] == len(saved)


def _ids(out: Path) -> list[str]:
    from eagle3.generate.storage import iter_samples

    return [s["id"] for s in iter_samples(out, on_bad=lambda *_: None)]


def test_sigint_of_train_exits_130_and_a_rerun_resumes_its_checkpoint(
    trained_draft, smol_model, tmp_path
):
    root = trained_draft.parents[1]  # the session's tiny run: extract/, vocab/, train/
    extract_dir, vocab = root / "extract", root / "vocab" / "vocab.safetensors"
    out, log = tmp_path / "train", tmp_path / "train.log"
    over = [
        f"paths.runs_dir={tmp_path}",
        "train.epochs=4",
        "train.lr=1e-3",
        "train.token_budget=256",
        "train.checkpoint_every_steps=1",
        "vocab.draft_vocab_size=512",
    ]
    argv = ["train", "-c", str(CPU_PROFILE), "--extract-dir", str(extract_dir)]
    proc = start([*argv, "--vocab-file", str(vocab), "--out", str(out), *sets(over)], log)
    state = out / "checkpoints" / "latest" / "state.json"
    wait_for(proc, log, "the first checkpoint", state.exists)
    text, sessions = interrupt(proc, log, signal.SIGINT)
    assert proc.returncode == 130, text
    assert (
        "interrupted (SIGINT): every server this command started was stopped; what it had "
        "written is kept. Rerun the same command to resume."
    ) in text, text
    assert "Traceback" not in text and not (out / "manifest.json").exists(), text
    left = proctree.wait_gone(sessions, 30)
    assert not left, proctree.describe(left)
    step = json.loads(state.read_text())["state"]["step"]
    from eagle3.config import load_config
    from eagle3.train import train

    cfg = load_config(CPU_PROFILE, over)
    steps: list[int] = []  # a rerun from scratch would report steps 1, 2, ..
    m = train(
        cfg,
        extract_dir,
        vocab,
        smol_model,
        out,
        lambda p: steps.append(p["step"]),
        max_steps=step + 1,
    )
    assert step >= 1 and steps == [step + 1] and m["step"] == step + 1, (step, steps)


def _generate_folder(dst: Path, copies: int) -> Path:
    """The checked-in 8 SmolLM2 samples ``copies`` times over (new ids): enough forward passes
    that a kill after the first shard lands mid-run."""
    dst.mkdir(parents=True)
    lines = (GENERATED / "samples-00000.jsonl").read_text().splitlines()
    with open(dst / "samples-00000.jsonl", "w") as f:
        for c in range(copies):
            for ln in lines:
                r = json.loads(ln)
                f.write(json.dumps({**r, "id": f"{r['id']}-{c}"}) + "\n")
    m = json.loads((GENERATED / "manifest.json").read_text())
    m["totals"]["samples"] = copies * len(lines)
    (dst / "manifest.json").write_text(json.dumps(m))
    return dst


def test_kill_9_of_extract_then_a_rerun_resumes(smol_model, tmp_path):
    gen = _generate_folder(tmp_path / "gen", 4)
    out, log = tmp_path / "ext", tmp_path / "extract.log"
    over = [
        f"paths.runs_dir={tmp_path}",
        "extract.backend=hf",
        "extract.samples_per_shard=1",
        "extract.token_budget=64",
    ]
    argv = ["extract", "-c", str(CPU_PROFILE), "--generate-dir", str(gen), "--out", str(out)]
    proc = start([*argv, *sets(over)], log)
    index = out / "index.json"
    wait_for(proc, log, "the first shard", index.exists)
    _, sessions = interrupt(proc, log, signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL
    assert not proctree.wait_gone(sessions, 30)
    kept = json.loads(index.read_text())
    assert 1 <= len(kept) < 32, f"the kill must land mid-run: {len(kept)} of 32 stored"
    shards = {p.name: p.stat().st_mtime_ns for p in out.glob("hidden-*.safetensors")}
    from eagle3.extract.runner import extract
    from eagle3.extract.storage import check_shard

    m = extract(gen_cfg(tmp_path, *over), gen, out, str(smol_model))
    assert m["samples"] == 32 and m["this_run"]["resumed_from"] == len(kept), m["this_run"]
    index_after = json.loads(index.read_text())
    assert set(kept) <= set(index_after) and len(index_after) == 32
    assert all(index_after[i] == kept[i] for i in kept), "a stored sample was extracted again"
    for name, mtime in shards.items():  # whole shards kept as they were, the rest added
        if name in {v[0] for v in kept.values()}:
            assert (out / name).stat().st_mtime_ns == mtime, name
    for shard in out.glob("hidden-*.safetensors"):
        check_shard(shard)
    assert not list(out.glob(".hidden-*.tmp"))
    shutil.rmtree(gen)
