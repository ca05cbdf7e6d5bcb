"""Every deployment `make ui` serves, served and started once, and kill -9 of a served hero run
whose generate stage started its own vLLM server (issue 42).

Real parts: the session's Prefect server (``prefect_backend``), `python -m flows.serve` serving
all seven deployments (what `make ui` runs), flow runs created through Prefect's API (what the
UI's Run button calls) and executed by that runner as processes of their own. The deployments
point at a copy of the session's tiny hero run, so hero-run, nightly-regeneration and the stages
generate .. train are cache hits and take seconds; verify runs for real against the session's
vLLM server given as its speculative server too: a server with no draft, so its gate refuses
("no speculative drafts were counted"), which is the verify stage's own answer.

The kill -9: a generate run of the same runner with a fresh dataset and the process backend starts
its own vLLM server; once a sample is saved the flow run's process gets SIGKILL. No cleanup runs in
it; the server asked for SIGTERM at its parent's death (eagle3/serving/process.py) and the runner
runs the crash hook (servers.json). Asserted: the run ends CRASHED, no process of the server's
session is left (EngineCore and workers included), and a rerun resumes the samples saved.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time

import httpx
import pytest

from tests import proctree
from tests.conftest import CPU_PROFILE, TINY_STAGES
from tests.test_faults import whole_records, write_prompts
from tests.test_ui_browser import _start, _stop, _wait

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


def _api() -> str:
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value()


def _deployments(api: str, names: list[str]) -> dict[str, dict] | None:
    r = httpx.post(
        f"{api}/deployments/filter",
        json={"deployments": {"name": {"any_": names}}, "flows": {"name": {"any_": ["hero-run"]}}},
        timeout=10,
    )
    found = {d["name"]: d for d in r.json()} if r.status_code == 200 else {}
    return found if set(found) == set(names) else None


def _run(api: str, dep: dict, params: dict | None = None) -> str:
    body = {"parameters": {"params": params}} if params else {}
    for _ in range(
        20
    ):  # 503: a retryable server error (SQLite busy), what Prefect's client retries
        r = httpx.post(f"{api}/deployments/{dep['id']}/create_flow_run", json=body, timeout=10)
        if r.status_code != 503:
            break
        time.sleep(0.5)
    assert r.status_code in (200, 201), r.text
    return r.json()["id"]


def _flow_run(api: str, run_id: str) -> dict:
    return httpx.get(f"{api}/flow_runs/{run_id}", timeout=10).json()


def _task_names(api: str, run_id: str) -> set[str]:
    r = httpx.post(
        f"{api}/task_runs/filter", json={"flow_runs": {"id": {"any_": [run_id]}}}, timeout=10
    )
    return {t["name"].rsplit("-", 1)[0] for t in r.json()}


def test_every_deployment_is_served_and_runs_and_kill_9_leaves_no_server(
    prefect_backend, tiny_hero, vllm_server, tmp_path
):
    from flows.serve import DEPLOYMENT_NAMES

    api = _api()
    runs = tmp_path / "runs"
    shutil.copytree(tiny_hero.runs_dir, runs, symlinks=True)
    overrides = [
        *tiny_hero.with_runs_dir(runs),
        f"verify.speculative_base_url={vllm_server.base_url}",
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(
        PREFECT_API_URL=api,
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_RUNNER_POLL_FREQUENCY="1",
    )
    argv = [sys.executable, "-m", "flows.serve", "--profile", str(CPU_PROFILE)]
    argv += ["--stages", ",".join(TINY_STAGES), "--limit", "2"]
    for o in overrides:
        argv += ["--set", o]
    log = tmp_path / "serve.log"
    serve = _start(argv, env, log)
    procs = [(serve, log)]
    sessions: set[int] = set()
    try:
        deps = _wait("every deployment", lambda: _deployments(api, DEPLOYMENT_NAMES), 120, procs)
        # first the run that loads a vLLM server; the cached runs take the runner's other slot
        killed = _start_generate_with_its_own_server(api, deps["generate"], tmp_path)
        started = {name: _run(api, deps[name]) for name in DEPLOYMENT_NAMES}
        sessions = _kill_9_and_rerun(api, killed, serve, vllm_server.base_url, procs)

        def finished() -> dict | None:
            states = {n: _flow_run(api, r)["state_type"] for n, r in started.items()}
            return states if FINAL >= set(states.values()) else None

        states = _wait("every deployment's run ended", finished, 300, procs)
        verify = _flow_run(api, started.pop("verify"))
        assert states.pop("verify") == "FAILED", verify["state"]
        assert "no speculative drafts were counted" in verify["state"]["message"], verify["state"]
        assert states == {n: "COMPLETED" for n in started}, (states, log.read_text()[-4000:])
        for name, run_id in started.items():
            stages = TINY_STAGES if name in ("hero-run", "nightly-regeneration") else [name]
            assert set(stages) <= _task_names(api, run_id), (name, _task_names(api, run_id))
    finally:
        _stop(serve)
        proctree.kill_sessions(sessions)


def _start_generate_with_its_own_server(api: str, dep: dict, tmp_path) -> dict:
    """The generate deployment on 24 fresh prompts with a vLLM server of its own (process
    backend): its flow run and what a rerun needs."""
    from eagle3.serving.readiness import free_port
    from flows.hero_run import HeroRunParams

    fresh = tmp_path / "fresh"
    data = write_prompts(tmp_path / "p.jsonl", 24)
    over = [
        f"paths.runs_dir={fresh}",
        f"generate.dataset={data}",
        "generate.num_samples=null",
        "generate.max_tokens=16",
        "generate.concurrency=4",
    ]
    params = HeroRunParams(
        profile=str(CPU_PROFILE),
        overrides=[*over, f"serve.port={free_port()}"],
        stages=["generate"],
    )
    return {"id": _run(api, dep, params.model_dump()), "over": over, "root": fresh / "smollm2-cpu"}


def _kill_9_and_rerun(api: str, killed: dict, serve, base_url: str, procs) -> set[int]:
    """SIGKILL the flow run's process once a sample is saved; assert what is left and that a
    rerun (in this process, against the session's server) resumes. The server's sessions."""
    from flows.hero_run import HeroRunParams, hero_run

    gen_root = killed["root"] / "generate"

    def folders() -> list:
        return [d for d in gen_root.iterdir() if d.is_dir() and not d.is_symlink()]

    _wait(
        "the first sample saved",
        lambda: gen_root.exists() and any(map(_ids, folders())),
        300,
        procs,
    )
    sessions = proctree.led_by(proctree.sessions(serve.pid, own=False), "vllm.entrypoints")
    assert len(sessions) == 1, "the run's vLLM server runs in a session of its own"
    flow_pid = proctree.processes()[next(iter(sessions))].ppid  # the flow run's process
    assert "prefect.engine" in proctree.cmdline(flow_pid), proctree.cmdline(flow_pid)
    os.kill(flow_pid, signal.SIGKILL)

    def state() -> str:
        return _flow_run(api, killed["id"])["state_type"]

    _wait("the killed run marked crashed", lambda: state() == "CRASHED", 120, procs)
    # the runner ran the crash hook: the run's entry is gone from servers.json (tasks/serve.py)
    registry = killed["root"] / "serve" / "servers.json"

    def listed() -> list:
        return [e for e in json.loads(registry.read_text()) if e["flow_run_id"] == killed["id"]]

    _wait("the crash hook", lambda: registry.exists() and not listed(), 60, procs)
    left = proctree.wait_gone(sessions, 60)
    if left:  # named, then killed: a failed run must not leave a server behind either
        found = proctree.describe(left)
        proctree.kill_sessions(sessions)
        raise AssertionError(f"kill -9 left processes of the run's vLLM server:\n{found}")
    (folder,) = folders()
    before = whole_records(folder)
    assert 0 < len(before) < 24, "the kill must land mid-run"
    over = [*killed["over"], "serve.backend=external", f"serve.base_url={base_url}"]
    summary = hero_run(HeroRunParams(profile=str(CPU_PROFILE), overrides=over, stages=["generate"]))
    after = whole_records(folder)
    assert len(after) == len(set(after)) == 24 and set(before) <= set(after)
    assert summary["generate_status"]["done"] == len(before), summary["generate_status"]
    return sessions


def _ids(folder) -> list[str]:
    from eagle3.generate.storage import iter_samples

    return [s["id"] for s in iter_samples(folder, on_bad=lambda *_: None)]
