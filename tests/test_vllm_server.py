"""The process backend against a REAL vLLM CPU server serving SmolLM2."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from eagle3.config import load_config
from eagle3.serving.client import chat
from eagle3.serving.readiness import ServerDiedError
from eagle3.serving.server import start_server
from tests.conftest import CPU_PROFILE, ROOT, require_vllm

pytestmark = pytest.mark.vllm


def vllm_processes(marker: str) -> list[str]:
    """Command lines of live processes that mention ``marker`` (e.g. a port)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = (
                Path(f"/proc/{pid}/cmdline")
                .read_bytes()
                .replace(b"\0", b" ")
                .decode(errors="replace")
            )
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmd and state != "Z" and int(pid) != os.getpid():
            found.append(f"{pid}: {cmd[:160]}")
    return found


def test_chat_with_exact_token_ids(vllm_server, smol_model):
    r = chat(
        vllm_server.base_url, vllm_server.model, "What is the capital of France?", max_tokens=24
    )
    assert "paris" in r.content.lower()
    assert r.prompt_token_ids and r.completion_token_ids
    tok = AutoTokenizer.from_pretrained(smol_model)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
    )["input_ids"]
    assert r.prompt_token_ids == list(prompt), "server and local chat template disagree"
    assert tok.decode(r.completion_token_ids, skip_special_tokens=True).strip() == r.content.strip()
    assert r.finish_reason == "stop" and r.completion_token_ids[-1] == tok.convert_tokens_to_ids(
        "<|im_end|>"
    )


def test_cli_serve_ctrl_c_leaves_no_process(smol_model, tmp_path):
    """`eagle3 serve --hold`, then Ctrl-C (SIGINT): the server and its engine processes are gone."""
    cfg = load_config(CPU_PROFILE)
    require_vllm(cfg)
    from eagle3.serving.readiness import free_port

    port = free_port()
    cli = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "eagle3.cli",
            "serve",
            "-c",
            str(CPU_PROFILE),
            "--set",
            f"serve.port={port}",
            "--set",
            f"paths.runs_dir={tmp_path}",
            "--chat",
            "Say hi.",
            "--hold",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    out = []
    try:
        for line in cli.stdout:
            out.append(line)
            if "serving; Ctrl-C stops the server" in line:
                break
        assert any("ready in" in ln for ln in out), "".join(out)
        assert any('"completion_token_ids"' in ln for ln in out)
        assert vllm_processes(f"--port {port}"), "server should be running before Ctrl-C"
        os.killpg(cli.pid, signal.SIGINT)
        rest, _ = cli.communicate(
            timeout=120
        )  # keep draining its output: a full pipe would block the exit
        out.append(rest or "")
    finally:
        if cli.poll() is None:
            os.killpg(cli.pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while vllm_processes(f"--port {port}") and time.monotonic() < deadline:
        time.sleep(0.5)
    assert vllm_processes(f"--port {port}") == []
    # the engine core and workers do not carry the port in their command line: find their pids in the log
    log = next((tmp_path / "smollm2-cpu" / "serve").glob(f"vllm-{port}-*.log")).read_text()
    pids = {int(p) for p in re.findall(r"\((?:APIServer|EngineCore|Worker)[^)]* pid=(\d+)\)", log)}
    assert len(pids) >= 2, "expected API server and engine core pids in the log"
    alive = [p for p in pids if Path(f"/proc/{p}").exists() and _not_zombie(p)]
    assert alive == [], f"vLLM processes left after Ctrl-C: {alive}"


def _not_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_early_death_reports_exit_code_and_log(smol_model, tmp_path):
    """A model folder vLLM cannot load: the error comes as soon as vLLM exits, with its log."""
    bad = tmp_path / "bad-model"
    bad.mkdir()
    for f in smol_model.iterdir():
        (bad / f.name).symlink_to(f)
    (bad / "config.json").unlink()
    conf = json.loads((smol_model / "config.json").read_text()) | {
        "architectures": ["NoSuchModelForCausalLM"]
    }
    (bad / "config.json").write_text(json.dumps(conf))
    # death seen when it happens: at the timeout it would be a ServerTimeoutError, not this
    cfg = load_config(CPU_PROFILE, ["serve.ready_timeout_s=300", f"paths.runs_dir={tmp_path}"])
    with pytest.raises(ServerDiedError) as e:
        start_server(cfg, str(bad))
    msg = str(e.value)
    assert "exited with code" in msg and "NoSuchModelForCausalLM" in msg
