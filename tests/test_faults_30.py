"""Data integrity and the last unclear failures (issue #30): one test per numbered item.

Real parts: the session's vLLM server (the right ids), bench/zero_server.py (a server whose ids
are canned, [9, 8, 7, 6, 5] for every prompt, with no /tokenize: what a wrong server, a stub or a
proxy does), the SmolLM2 tokenizer and model, a vLLM server of its own for the SIGTERM while it
loads. Each test failed on the commit before the fix (docs/faults.md, "Issue #30").
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

from eagle3.errors import EndpointError, NoResult, TokenIdMismatch
from eagle3.generate.runner import generate
from eagle3.generate.storage import iter_samples
from eagle3.serving.process import group_members
from eagle3.serving.readiness import free_port
from tests.conftest import CPU_PROFILE, ROOT, gen_cfg
from tests.test_faults import _pids_with_arg, line, sample, write_generate_dir, write_prompts

SERVED = "smollm2-135m-instruct"  # the profile's served name: the zero server lists it too


@pytest.fixture
def zero_server():
    """bench/zero_server.py listing ``SERVED``: a server that answers every prompt at once with
    canned token ids that are not SmolLM2's."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "bench" / "zero_server.py"), str(port), SERVED],
        stdout=subprocess.PIPE,
        text=True,
    )
    proc.stdout.readline()
    yield f"http://127.0.0.1:{port}"
    proc.kill()
    proc.wait()


def local_ids_match(out: Path, model: Path) -> tuple[int, int]:
    """(samples, samples whose prompt ids are the local tokenizer + template's)."""
    from transformers import AutoTokenizer

    from eagle3.tokens import template_prompt_ids

    tok = AutoTokenizer.from_pretrained(model)
    samples = list(iter_samples(out))
    same = sum(template_prompt_ids(tok, s["messages"]) == s["prompt_token_ids"] for s in samples)
    return len(samples), same


def cli(*args: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "eagle3.cli", *args]
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)


# --- 1: every sample is checked; a rerun re-checks and replaces what an old run stored -----------


@pytest.mark.vllm
def test_canned_ids_at_concurrency_32_store_nothing_and_a_rerun_replaces_old_ones(
    vllm_server, zero_server, smol_model, tmp_path
):
    data = write_prompts(tmp_path / "p.jsonl", 40)
    cfg = gen_cfg(
        tmp_path, f"generate.dataset={data}", "generate.concurrency=32", "generate.max_tokens=4"
    )
    out = tmp_path / "gen"
    with pytest.raises(TokenIdMismatch, match="differ from the local tokenizer"):
        generate(cfg, [zero_server], out)
    stored = len(list(iter_samples(out)))
    assert stored == 0, f"{stored} samples with the wrong ids were stored"
    # a folder filled before the fix (only the first 8 were checked): 6 wrong samples in it
    old = gen_cfg(tmp_path, f"generate.dataset={data}", "generate.num_samples=6")
    generate(old, [zero_server], out, token_check=False)
    assert local_ids_match(out, smol_model) == (6, 0)
    m = generate(cfg, [vllm_server.base_url], out)  # the right server, the same folder
    assert m["this_run"]["counts"]["dropped_wrong_token_ids"] == 6
    assert local_ids_match(out, smol_model) == (40, 40), "every sample has the target's ids"
    assert m["token_check"]["unchecked_samples"] == 0 and m["totals"]["errors_by_kind"] == {}


# --- 2: a target that is not embedded is checked with target.model; no tokenizer is recorded ----


@pytest.mark.vllm
def test_a_local_folder_target_is_checked_and_an_unchecked_folder_is_refused(
    vllm_server, zero_server, smol_model, tmp_path, caplog
):
    from eagle3.extract.runner import extract

    data = write_prompts(tmp_path / "p.jsonl", 40)
    sets = [f"generate.dataset={data}", "generate.concurrency=32", "generate.max_tokens=4"]
    cfg = gen_cfg(tmp_path, *sets, f"target.model={smol_model}")  # target.tokenizer unset
    out = tmp_path / "gen"
    with pytest.raises(TokenIdMismatch, match=rf"differ from the local tokenizer {smol_model} "):
        generate(cfg, [zero_server], out)
    stored = len(list(iter_samples(out)))
    assert stored == 0, f"{stored} samples with the wrong ids were stored"
    generate(cfg, [vllm_server.base_url], out)
    assert local_ids_match(out, smol_model) == (40, 40)
    # a folder with no tokenizer in it: no check is possible, said loudly and recorded
    bare = tmp_path / "bare-model"
    bare.mkdir()
    shutil.copy(smol_model / "config.json", bare)
    few = write_prompts(tmp_path / "few.jsonl", 3)
    cfg = gen_cfg(tmp_path, f"generate.dataset={few}", f"target.model={bare}")
    m = generate(cfg, [zero_server], tmp_path / "unchecked")
    assert "Samples are stored UNCHECKED" in caplog.text
    assert (
        m["token_check"]["unchecked_samples"] == 3
        and f"{bare} cannot be loaded" in (m["token_check"]["unchecked"])
    )
    ext = gen_cfg(tmp_path, "extract.backend=hf")
    with pytest.raises(TokenIdMismatch, match=r"the token ids of 3 samples were not checked"):
        extract(ext, tmp_path / "unchecked", tmp_path / "ext", str(smol_model))
    told = gen_cfg(tmp_path, "extract.backend=hf", "extract.accept_unchecked_token_ids=true")
    assert extract(told, tmp_path / "unchecked", tmp_path / "ext", str(smol_model))["samples"] == 3


# --- 3: one line, no "Task exception was never retrieved" ----------------------------------------


def test_a_failed_run_prints_one_line_and_no_task_tracebacks(zero_server, tmp_path):
    data = write_prompts(tmp_path / "p.jsonl", 64)
    r = cli(
        "generate", "-c", str(CPU_PROFILE), "--base-url", zero_server,
        "--out", str(tmp_path / "gen"),
        "--set", f"generate.dataset={data}", "--set", "generate.concurrency=32",
    )  # fmt: skip
    err = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith("generate ")]
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "never retrieved" not in r.stderr and len(err) == 1, r.stderr
    assert err[0].startswith("error: the server's prompt token ids")


# --- 4: SIGTERM while the server loads stops it within seconds, and says so ----------------------


@pytest.mark.vllm
def test_sigterm_while_the_server_loads_stops_it_within_seconds(smol_model, tmp_path):
    port = free_port()
    data = write_prompts(tmp_path / "p.jsonl", 4)
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "eagle3.cli", "generate", "-c", str(CPU_PROFILE),
            "--out", str(tmp_path / "gen"),
            "--set", f"paths.runs_dir={tmp_path / 'runs'}", "--set", f"serve.port={port}",
            "--set", f"generate.dataset={data}", "--set", "serve.stop_timeout_s=600",
        ],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 600  # a loaded 2-core machine: generous
        while not _pids_with_arg("--port", str(port)) and proc.poll() is None:
            assert time.monotonic() < deadline, "no vLLM server process"
            time.sleep(0.2)
        servers = _pids_with_arg("--port", str(port))
        # vLLM's own SIGTERM handler is up once its API server runs (before that, Python's
        # default SIGTERM ends it at once): its engine core logs after that, still loading; from
        # then on main waited serve.stop_timeout_s
        while not loading_logged(tmp_path / "runs") and proc.poll() is None:
            assert time.monotonic() < deadline, "vLLM's engine core never logged"
            time.sleep(0.2)
        assert loading_logged(tmp_path / "runs") and servers and proc.poll() is None, (
            "the server must be loading"
        )
        proc.send_signal(signal.SIGTERM)
        # serve.stop_timeout_s is 600: a wait for it ends in TimeoutExpired here, not an exit
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "that was still loading: SIGTERM, then SIGKILL after 5 s" in err, err
    assert not any(group_members(pid) for pid in servers)


def loading_logged(runs: Path) -> bool:
    return any("(EngineCore pid=" in p.read_text() for p in runs.rglob("vllm-*.log"))


# --- 5: an unknown embedded model is one line with the known names ------------------------------


def test_an_unknown_embedded_model_is_one_line(tmp_path):
    for command in (["generate", "--base-url", "http://127.0.0.1:9"], ["serve"]):
        r = cli(
            *command, "-c", str(CPU_PROFILE), "--set", "target.model=embedded:nope",
            "--set", f"paths.runs_dir={tmp_path}",
        )  # fmt: skip
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert lines == [
            "error: unknown embedded model 'nope'; known: ['smollm2-135m-instruct', "
            "'tiny-deepseek-v3']"
        ], r.stderr


# --- 6: a wrong served name on a running server fails at once -----------------------------------


@pytest.mark.vllm
def test_a_wrong_served_model_name_fails_at_once(vllm_server, tmp_path):
    from eagle3.config import load_config
    from eagle3.serving.server import start_server

    cfg = load_config(
        CPU_PROFILE,
        [
            "serve.backend=external",
            f"serve.base_url={vllm_server.base_url}",
            "target.served_model_name=nope",
            "serve.ready_timeout_s=30",
        ],
    )
    # at once: waiting the list out would end in a ServerTimeoutError after 30 s, not this
    with pytest.raises(EndpointError, match=rf"does not list 'nope' \(it serves \['{SERVED}'\]\)"):
        start_server(cfg, "ignored")


# --- 7: a record without prompt_token_ids is a named unreadable line ----------------------------


def test_a_record_without_prompt_ids_is_named_and_skipped(cpu_cfg, smol_model, tmp_path):
    from eagle3.extract.runner import extract
    from eagle3.generate.storage import ShardStore

    good = [line(sample(i, [1, 2, 3], [4, 5])) for i in range(2)]
    no_ids = {k: v for k, v in sample(5, [1], [2]).items() if k != "prompt_token_ids"}
    root = write_generate_dir(tmp_path / "gen", [[good[0], line(no_ids), good[1]]], listed=3)
    m = extract(gen_cfg(tmp_path, "extract.backend=hf"), root, tmp_path / "ext", str(smol_model))
    assert m["samples"] == 2 and m["this_run"]["unreadable"] == 1
    (reason,) = [
        json.loads(x)["reason"] for x in (tmp_path / "ext" / "errors.jsonl").read_text().split("\n")
        if x
    ]  # fmt: skip
    assert reason.startswith(f"{root}/samples-00000.jsonl:2: unreadable line (not a sample record")
    assert "prompt_token_ids" in reason
    store = ShardStore(root)  # generate requests it again
    assert store.done_ids == {"s0", "s1"}
    store.close()


# --- 8: a checkpoint resumes only on the extract it was trained on ------------------------------


def test_train_does_not_resume_a_checkpoint_of_another_extract(tmp_path):
    from eagle3.train import TrainingDiverged, train
    from tests.test_train import make_cfg, make_data, make_target, make_vocab

    target, embed = make_target(tmp_path / "target")
    bad = make_data(tmp_path / "nan", embed, n=8, nan_ids=(3,))  # one batch per epoch: all NaN
    vocab = make_vocab(bad, tmp_path / "vocab.safetensors")
    cfg = make_cfg(epochs=2, token_budget=1024)
    with pytest.raises(TrainingDiverged):
        train(cfg, bad, vocab, target, tmp_path / "train")
    clean = make_data(tmp_path / "clean", embed, n=8)  # the same samples, finite
    m = train(cfg, clean, vocab, target, tmp_path / "train")  # the same output folder
    assert m["complete"] and m["resumed_from_step"] is None and m["updates"] == m["steps"] == 2


# --- 9: the nits -----------------------------------------------------------------------------


def test_nits_zero_samples_unreadable_lines_error_prefix_and_a_missing_dataset(scripted, tmp_path):
    # 0 samples: a failure, nothing sealed
    data = write_prompts(tmp_path / "p.jsonl", 2)
    cfg = gen_cfg(
        tmp_path,
        f"generate.dataset={data}",
        "target.served_model_name=zero",
        "generate.length_check=false",
    )
    with pytest.raises(NoResult, match=r"generate stored 0 samples .*errors.jsonl"):
        generate(cfg, [scripted("400,400")], tmp_path / "gen")
    assert not (tmp_path / "gen" / "manifest.json").exists()
    # extract's console line counts the unreadable lines and skipped samples
    from eagle3.cli_stages import extract_summary

    run = {"stored": 2, "reused": 0, "unreadable": 1, "skipped": 1}
    m = {"samples": 2, "tokens": 9, "bytes_per_token": 1.0, "storage_dtype": "bfloat16"}
    text = extract_summary(Path("ext"), {**m, "aux_layers": [1], "this_run": run})
    assert "1 unreadable lines and 1 skipped samples: see ext/errors.jsonl" in text
    # every one-line error has the prefix the docs show
    r = cli("run-stage", "nope", "-c", str(CPU_PROFILE))
    assert r.returncode == 1 and r.stderr.startswith("error: unknown stage 'nope'"), r.stderr
    # a missing dataset fails before any server starts (no --base-url: it would start one)
    r = cli(
        "generate", "-c", str(CPU_PROFILE), "--set", f"paths.runs_dir={tmp_path / 'runs'}",
        "--set", f"generate.dataset={tmp_path / 'missing.jsonl'}",
    )  # fmt: skip
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"error: dataset file {tmp_path / 'missing.jsonl'} not found" in r.stderr
    assert "server ready" not in r.stderr
    assert not list((tmp_path / "runs").rglob("vllm-*.log")), "no server was started"
