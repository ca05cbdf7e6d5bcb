"""The generate stage against REAL vLLM CPU servers (SmolLM2, plain and thinking)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from transformers import AutoTokenizer

from eagle3.generate.runner import ServerUnavailable, generate
from eagle3.generate.storage import iter_samples, latest_errors
from eagle3.tokens import rebuild_token_ids
from tests.conftest import CPU_PROFILE, ROOT, gen_cfg

pytestmark = pytest.mark.vllm


def write_prompts(path, n, extra=()):
    with open(path, "wb") as f:
        for i in range(n):
            f.write(
                json.dumps({"prompt": f"Write one short sentence about the number {i}."}).encode()
                + b"\n"
            )
        for line in extra:
            f.write(line + b"\n")
    return path


def test_generate_records_exact_tokens_and_bad_input(vllm_server, smol_model, tmp_path):
    long_prompt = "word " * 2100  # > max_model_len 2048 of the CPU profile
    data = write_prompts(
        tmp_path / "p.jsonl",
        6,
        [
            b'{"prompt": "unterminated',
            b'{"prompt": "bad \xff byte"}',
            b'{"prompt": ""}',
            json.dumps({"prompt": long_prompt}).encode(),
            json.dumps(
                {"prompt": "Write one short sentence about the number 0."}
            ).encode(),  # duplicate
        ],
    )
    cfg = gen_cfg(tmp_path, f"generate.dataset={data}", "generate.concurrency=4")
    out = tmp_path / "gen"
    m = generate(cfg, [vllm_server.base_url], out)
    samples = list(iter_samples(out))
    assert len(samples) == 6 and len({s["id"] for s in samples}) == 6
    tok = AutoTokenizer.from_pretrained(smol_model)
    for s in samples:
        assert (
            s["token_ids_source"] == "server"
            and s["prompt_token_ids"]
            and s["completion_token_ids"]
        )
        assert (
            tok.decode(s["completion_token_ids"], skip_special_tokens=True).strip()
            == (s["content"] or "").strip()
        )
        assert s["finish_reason"] in ("stop", "length") and s["truncated"] == (
            s["finish_reason"] == "length"
        )
        assert s["usage"]["completion_tokens"] == len(s["completion_token_ids"])
    reasons = sorted(e["reason"] for e in latest_errors(out).values())
    assert any(r.startswith("malformed JSON") for r in reasons)
    assert any(r.startswith("invalid UTF-8") for r in reasons)
    assert "empty prompt" in reasons
    assert any(r.startswith("prompt too long:") and "max model len 2048" in r for r in reasons), (
        reasons
    )
    assert m["totals"]["samples"] == 6 and m["totals"]["errors_by_kind"] == {"skipped": 4}
    assert m["this_run"]["prompt_rows"]["duplicates"] == 1
    assert m["dataset"]["fingerprint"] and m["concurrency"] == 4


def test_rejected_prompt_is_recorded_and_the_rest_go_on(vllm_server, tmp_path):
    data = write_prompts(tmp_path / "p.jsonl", 3, [json.dumps({"prompt": "word " * 2100}).encode()])
    cfg = gen_cfg(tmp_path, f"generate.dataset={data}", "generate.length_check=false")
    m = generate(cfg, [vllm_server.base_url], tmp_path / "gen")
    errors = list(latest_errors(tmp_path / "gen").values())
    assert m["totals"]["samples"] == 3 and len(errors) == 1
    assert errors[0]["kind"] == "rejected" and "rejected by server (400)" in errors[0]["reason"]
    # a rerun does not send the rejected prompt again
    m2 = generate(cfg, [vllm_server.base_url], tmp_path / "gen")
    assert m2["this_run"]["counts"] == {"previously_rejected": 1}


def test_kill_9_then_resume_loses_and_duplicates_nothing(vllm_server, tmp_path):
    data = write_prompts(tmp_path / "p.jsonl", 24)
    out = tmp_path / "gen"
    argv = [
        sys.executable,
        "-m",
        "eagle3.cli",
        "generate",
        "-c",
        str(CPU_PROFILE),
        "--base-url",
        vllm_server.base_url,
        "--out",
        str(out),
        "--set",
        f"generate.dataset={data}",
        "--set",
        "generate.max_tokens=24",
        "--set",
        "generate.concurrency=4",
        "--set",
        "generate.shard_size=7",
    ]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        done = sum(1 for _ in iter_samples(out)) if out.exists() else 0
        if done >= 8:
            break
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    before = [s["id"] for s in iter_samples(out)]
    assert 8 <= len(before) < 24, "the kill must land mid-run"
    # simulate the worst moment too: a record cut in half by the kill
    open_shard = next(out.glob("samples-*.jsonl.open"))
    with open(open_shard, "ab") as f:
        f.write(b'{"id": "torn", "messages": [{"role": "us')
    r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    after = [s["id"] for s in iter_samples(out)]
    assert len(after) == len(set(after)) == 24, "no sample lost, none duplicated"
    assert set(before) <= set(after) and "torn" not in after
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["this_run"]["resumed_from"] == len(before)
    assert manifest["this_run"]["torn_bytes_dropped"] > 0
    assert not list(out.glob("*.open"))


def test_server_death_fails_clearly_and_rerun_resumes(vllm_server, speculators_server, tmp_path):
    """A real vLLM server dies (SIGKILL of its process group) mid-generate: generate fails with
    how to resume, and a rerun against a live server resumes. The server that dies is the session's
    SmolLM2 in the speculators format (tests/conftest.py: its start also serves
    tests/test_draft_model.py's check of that format): a SmolLM2 server like any other to generate
    (the profile's served name, SmolLM2's token ids, greedy answers the target's own)."""
    data = write_prompts(tmp_path / "p.jsonl", 12)
    cfg = gen_cfg(
        tmp_path,
        f"generate.dataset={data}",
        "generate.concurrency=2",
        "generate.max_tokens=32",
        "generate.max_attempts=3",
    )
    out = tmp_path / "gen"
    doomed = speculators_server.take()
    killed = []

    def kill_after_some(p):
        if p.done >= 5 and not killed:
            os.killpg(doomed.pid, signal.SIGKILL)  # the server dies mid-run
            killed.append(p.done)

    try:
        with pytest.raises(
            ServerUnavailable, match="no endpoint answers /health any more.*rerun to resume"
        ):
            generate(cfg, [doomed.base_url], out, on_progress=kill_after_some)
    finally:
        doomed.stop()
    saved = {s["id"] for s in iter_samples(out)}
    assert killed and len(saved) >= 5
    assert not [e for e in latest_errors(out).values() if e["kind"] == "failed"], (
        "a dead server is not a bad sample"
    )
    m = generate(cfg, [vllm_server.base_url], out)  # rerun against a live server
    assert m["totals"]["samples"] == 12 and m["this_run"]["resumed_from"] == len(saved)


def test_several_endpoints_share_the_load(vllm_server, tmp_path):
    data = write_prompts(tmp_path / "p.jsonl", 8)
    cfg = gen_cfg(
        tmp_path,
        f"generate.dataset={data}",
        "generate.balancing=round_robin",
        "generate.concurrency=4",
    )
    other = vllm_server.base_url.replace("127.0.0.1", "localhost")
    generate(cfg, [vllm_server.base_url, other], tmp_path / "gen")
    used = [s["endpoint"] for s in iter_samples(tmp_path / "gen")]
    assert used.count(other) == 4 and used.count(vllm_server.base_url) == 4


FEW_SHOT = [
    ("What is 3+3?", "3 plus 3 is 6.", "The answer is 6."),
    ("What is the capital of Italy?", "Italy's capital is Rome.", "Rome."),
    ("What color is the sky?", "The sky looks blue.", "Blue."),
]


def test_reasoning_is_captured_and_token_ids_rebuild_identically(
    think_server, think_model, tmp_path
):
    """SmolLM2 does not think by itself: a few-shot history shows it how, under a template that opens <think>."""
    shots = [{"role": "system", "content": "Think inside <think> </think>, then answer."}]
    for q, r, a in FEW_SHOT:
        shots += [
            {"role": "user", "content": q},
            {"role": "assistant", "content": f"<think>\n{r}</think>{a}"},
        ]
    questions = [
        "What is 2+2?",
        "What is the capital of France?",
        "Name an animal.",
        "What is 10 minus 3?",
        "Name a color.",
        "What is the opposite of hot?",
    ]
    data = tmp_path / "p.jsonl"
    data.write_text(
        "".join(
            json.dumps({"messages": shots + [{"role": "user", "content": q}]}) + "\n"
            for q in questions
        )
    )
    cfg = gen_cfg(
        tmp_path,
        f"generate.dataset={data}",
        "generate.turns=history",
        "target.think_start_id=15",
        "target.think_end_id=16",
        "target.expects_reasoning=true",
        "generate.max_tokens=48",
    )
    # the served variant's template opens <think>: its tokenizer checks the server's ids
    m = generate(cfg, [think_server.base_url], tmp_path / "gen", tokenizer_path=str(think_model))
    samples = list(iter_samples(tmp_path / "gen"))
    assert len(samples) == 6
    with_reasoning = [s for s in samples if s["reasoning"]]
    assert len(with_reasoning) >= 4, [s["reasoning"] for s in samples]
    assert m["totals"]["flags"].get("no_reasoning", 0) == 6 - len(with_reasoning)
    tok = AutoTokenizer.from_pretrained(think_model)
    for s in samples:
        assert s["prompt_token_ids"][-2:] == [15, 198]  # the template opened <think>\n
        prompt_ids, completion_ids = rebuild_token_ids(
            tok,
            s["messages"],
            s["reasoning"],
            s["content"],
            s["finish_reason"],
            think_start_id=15,
            think_end_id=16,
        )
        assert prompt_ids == s["prompt_token_ids"]
        assert completion_ids == s["completion_token_ids"], s


def test_expected_reasoning_missing_is_flagged(vllm_server, tmp_path):
    data = write_prompts(tmp_path / "p.jsonl", 2)
    cfg = gen_cfg(
        tmp_path,
        f"generate.dataset={data}",
        "target.think_start_id=15",
        "target.think_end_id=16",
        "target.expects_reasoning=true",
    )
    m = generate(cfg, [vllm_server.base_url], tmp_path / "gen")
    assert m["totals"]["flags"]["no_reasoning"] == 2
    assert all("no_reasoning" in s["flags"] for s in iter_samples(tmp_path / "gen"))


def test_profile_concurrency_and_auto(vllm_server, tmp_path):
    data = write_prompts(tmp_path / "p.jsonl", 8)
    out = tmp_path / "prof"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "eagle3.cli",
            "generate",
            "-c",
            str(CPU_PROFILE),
            "--base-url",
            vllm_server.base_url,
            "--out",
            str(out),
            "--set",
            f"generate.dataset={data}",
            "--set",
            "generate.concurrency=auto",
            "--set",
            "generate.profile_levels=[1,4]",
            "--set",
            "generate.profile_prompts=4",
            "--set",
            "generate.profile_max_tokens=8",
            "--set",
            "generate.max_tokens=8",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    report = json.loads((out / "profile" / "concurrency-profile.json").read_text())
    tps = {lv["concurrency"]: lv["tokens_per_s"] for lv in report["levels"]}
    assert list(tps) == [1, 4] and min(tps.values()) > 0
    # the knee: the smallest level within profile_knee (0.97) of the best throughput
    best = max(tps, key=tps.get)
    knee = min(c for c in tps if tps[c] >= report["knee_fraction"] * tps[best])
    assert report["knee_fraction"] == 0.97 and (report["best"], report["knee"]) == (best, knee), tps
    assert (out / "profile" / "concurrency-profile.png").stat().st_size > 1000
    assert json.loads((out / "manifest.json").read_text())["concurrency"] == report["knee"]
    assert "concurrency auto ->" in r.stderr
