"""Stopping a run stops its servers (issue #16, finding 1): `eagle3 verify` on SIGINT, and a hero run
cancelled from Prefect (the UI's Cancel button sends the same API call as here).

Real parts only: `eagle3 verify` starts its own vLLM CPU servers; the cancellation test runs a Prefect
server, `flows.serve`'s runner and a hero run whose generate stage starts its own vLLM server, and
cancels the run through Prefect's API. Each asserts that no process of the server's session is
left (its EngineCore and workers included: tests/proctree.py). (`eagle3 generate` on SIGTERM:
tests/test_faults.py; SIGINT to generate and train, kill -9: tests/test_kill.py.)
"""

from __future__ import annotations

import os
import signal
import sys

import httpx
import pytest

from eagle3.generate.storage import iter_samples
from eagle3.serving.readiness import free_port
from tests import proctree
from tests.conftest import CPU_PROFILE
from tests.test_faults import sigterm_when, write_prompts
from tests.test_ui_browser import _deployment, _start, _stop, _wait

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _health(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _saved(runs) -> bool:
    """At least one sample saved by the run's generate stage."""
    root = runs / "smollm2-cpu" / "generate"
    return root.exists() and any(
        next(iter_samples(d, on_bad=lambda *_: None), None) is not None
        for d in root.iterdir()
        if d.is_dir() and not d.is_symlink()
    )


def test_sigint_of_verify_stops_its_server(trained_draft, tmp_path):
    """Ctrl-C (SIGINT) while verify measures its first server: exit 130, the line, nothing left."""
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "eagle3.cli",
        "verify",
        "-c",
        str(CPU_PROFILE),
        "--draft",
        str(trained_draft),
        "--out",
        str(tmp_path / "verify"),
        "--set",
        f"paths.runs_dir={tmp_path / 'runs'}",
        "--set",
        f"serve.port={port}",
        "--set",
        "verify.num_prompts=2",
        "--set",
        "verify.max_tokens=64",
    ]
    returncode, err, sessions = sigterm_when(
        argv,
        lambda: _health(port),
        240,
        "verify must be running with its first server up",
        sig=signal.SIGINT,
    )
    assert returncode == 128 + signal.SIGINT == 130, err
    assert "interrupted (SIGINT): every server this command started was stopped" in " ".join(
        err.split()
    ), err
    left = proctree.wait_gone(sessions, 10)
    assert not left, f"left by verify or its server:\n{proctree.describe(left)}"


def test_cancelling_a_hero_run_in_prefect_stops_its_server(tmp_path):
    port, api_port = free_port(), free_port()
    api = f"http://127.0.0.1:{api_port}/api"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(
        PREFECT_HOME=str(tmp_path / "prefect-home"),
        PREFECT_API_URL=api,
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_RUNNER_POLL_FREQUENCY="2",
    )
    data = write_prompts(tmp_path / "prompts.jsonl", 300)
    runs = tmp_path / "runs"
    server_log, serve_log = tmp_path / "server.log", tmp_path / "serve.log"
    server = _start(
        [
            sys.executable,
            "-m",
            "prefect",
            "server",
            "start",
            "--host",
            "127.0.0.1",
            "--port",
            str(api_port),
        ],
        env,
        server_log,
    )
    procs = [(server, server_log)]
    serve, sessions = None, set()
    try:
        _wait(
            "prefect server",
            lambda: httpx.get(f"{api}/health", timeout=2).status_code == 200,
            120,
            procs,
        )
        argv = [
            sys.executable,
            "-m",
            "flows.serve",
            "--only",
            "hero-run",
            "--profile",
            str(CPU_PROFILE),
            "--stages",
            "generate",
        ]
        for o in (
            f"paths.runs_dir={runs}",
            f"serve.port={port}",
            f"generate.dataset={data}",
            "generate.num_samples=null",
            "generate.max_tokens=64",
            "generate.concurrency=2",
        ):
            argv += ["--set", o]
        serve = _start(argv, env, serve_log)
        procs.append((serve, serve_log))

        dep = _wait("hero-run deployment", lambda: _deployment(api, "hero-run"), 120, procs)
        run = httpx.post(
            f"{api}/deployments/{dep['id']}/create_flow_run", json={}, timeout=10
        ).json()

        def state() -> str:
            return httpx.get(f"{api}/flow_runs/{run['id']}", timeout=5).json()["state_type"]

        _wait("the run's own vLLM server up", lambda: _health(port), 240, procs)
        # the sessions of every process below the runner but its own: the vLLM server's
        sessions = proctree.sessions(serve.pid, own=False)
        assert sessions, "the run's vLLM server runs in a session of its own"
        # mid-generate: the smoke chat done, samples being written, requests in flight (300 prompts)
        _wait("the first sample saved", lambda: _saved(runs), 120, procs)
        assert state() == "RUNNING"
        r = httpx.post(
            f"{api}/flow_runs/{run['id']}/set_state",
            timeout=10,
            json={"state": {"type": "CANCELLING", "name": "Cancelling"}, "force": True},
        )
        assert r.status_code in (200, 201), r.text
        _wait("the run cancelled", lambda: state() == "CANCELLED", 120, procs)
        left = proctree.wait_gone(sessions, 30)
        assert not left, (
            f"the cancelled run left processes of its vLLM server:\n{proctree.describe(left)}\n"
            f"{serve_log.read_text()[-3000:]}"
        )
        # what was written is whole and readable
        for gen_dir in (runs / "smollm2-cpu" / "generate").iterdir():
            if not gen_dir.is_dir():
                continue
            bad: list = []
            saved = [
                s["id"] for s in iter_samples(gen_dir, on_bad=lambda *b, bad=bad: bad.append(b))
            ]
            assert not bad and len(set(saved)) == len(saved), bad
    finally:
        if serve is not None:
            _stop(serve)
        _stop(server)
        # never leave a server behind, even on failure
        proctree.kill_sessions(sessions)
