"""The Prefect UI in a real browser: a user starts a hero run from the UI's own buttons.

A Prefect server (`prefect server start`, SQLite in a temporary PREFECT_HOME, 127.0.0.1) and the
deployments (`python -m flows.serve`, what `make ui` runs) are started as processes; headless
Chromium (Debian's, driven by Playwright) opens the UI, goes to Deployments -> hero-run and
clicks Run -> Quick run. The test then follows the flow run through the API until it is
COMPLETED. The deployment's parameters point at the session's tiny hero run, whose stages are
all cached, so the run takes seconds. Screenshots go to test-artifacts/.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import ARTIFACTS, CPU_PROFILE, ROOT, TINY_STAGES

pytestmark = pytest.mark.vllm
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


def _free_port() -> int:
    from eagle3.serving.readiness import free_port

    return free_port("127.0.0.1")


def _start(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with open(log, "wb") as f:
        return subprocess.Popen(
            argv,
            cwd=ROOT,
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def _wait(what: str, check, timeout_s: float, procs: list[tuple[subprocess.Popen, Path]]) -> object:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for proc, log in procs:
            if proc.poll() is not None:
                pytest.fail(
                    f"{what}: {proc.args[:4]} exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
                )
        try:
            found = check()
        except httpx.HTTPError:
            found = None
        if found:
            return found
        time.sleep(0.5)
    logs = "\n".join(f"--- {log} ---\n{log.read_text()[-3000:]}" for _, log in procs)
    pytest.fail(f"{what}: not within {timeout_s} s\n{logs}")


def _deployment(api: str, name: str) -> dict | None:
    """The deployment called ``name`` once the runner has registered it."""
    r = httpx.post(
        f"{api}/deployments/filter", json={"deployments": {"name": {"any_": [name]}}}, timeout=5
    )
    return r.json()[0] if r.status_code == 200 and r.json() else None


def test_start_hero_run_from_the_ui(tiny_hero, tmp_path):
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(
            "Debian's chromium is missing: `make test` installs it (apt-get install chromium)"
        )
    from playwright.sync_api import sync_playwright

    started = time.monotonic()
    # a copy of the session's run: this hero run rewrites its summary (tests/test_flow.py reads
    # the session's own)
    runs = tmp_path / "runs"
    shutil.copytree(tiny_hero.runs_dir, runs, symlinks=True)
    port = _free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(
        PREFECT_HOME=str(tmp_path / "prefect-home"),
        PREFECT_API_URL=api,
        PREFECT_UI_API_URL=api,
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_RUNNER_POLL_FREQUENCY="2",
        PREFECT_LOGGING_LEVEL="INFO",
    )
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
            str(port),
        ],
        env,
        server_log,
    )
    procs = [(server, server_log)]
    serve = None
    ARTIFACTS.mkdir(exist_ok=True)
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
            ",".join(TINY_STAGES),
        ]
        for o in tiny_hero.with_runs_dir(runs):
            argv += ["--set", o]
        serve = _start(argv, env, serve_log)
        procs.append((serve, serve_log))

        dep = _wait("hero-run deployment", lambda: _deployment(api, "hero-run"), 120, procs)
        assert dep["parameters"]["params"]["stages"] == TINY_STAGES
        ui_started = time.monotonic()

        with sync_playwright() as p:
            browser = p.chromium.launch(
                executable_path=CHROMIUM, args=["--no-sandbox", "--disable-dev-shm-usage"]
            )
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            try:
                page.goto(f"http://127.0.0.1:{port}/deployments", wait_until="networkidle")
                page.locator(
                    "a[href^='/deployments/deployment/']", has_text="hero-run"
                ).first.click()
                page.wait_for_url(f"**/deployments/deployment/{dep['id']}**")
                # the page's own requests done first: on a loaded CI machine a click on Quick run
                # before the deployment had loaded scheduled nothing (no run within 30 s)
                page.wait_for_load_state("networkidle")

                def flow_runs() -> list[dict]:
                    r = httpx.post(
                        f"{api}/flow_runs/filter",
                        timeout=5,
                        json={"flow_runs": {"deployment_id": {"any_": [dep["id"]]}}},
                    )
                    return r.json() if r.status_code == 200 else []

                failed: list[str] = []  # the page's requests the server answered with an error
                page.on(
                    "response",
                    lambda r: (
                        failed.append(f"{r.request.method} {r.url} -> {r.status}")
                        if r.status >= 400
                        else None
                    ),
                )
                scheduled = page.get_by_text("scheduled to start")
                oops = page.get_by_text("Something went wrong")
                for attempt in range(3):
                    page.get_by_role("button", name="Run", exact=True).click()
                    page.get_by_text("Quick run").first.click()
                    # the UI's own answer: a toast "<run name> scheduled to start now", or its
                    # error toast (CI once: "Oops. Something went wrong", no run created). A
                    # person clicks again then; so does the test, only when no run exists.
                    scheduled.or_(oops).first.wait_for(timeout=90_000)
                    if scheduled.first.is_visible():
                        break
                    page.wait_for_load_state("networkidle")  # no create request still in flight
                    assert not flow_runs(), "the UI reported an error but created a run"
                    print(f"Quick run {attempt + 1}: the UI reported an error; failed: {failed}")
                    page.reload(wait_until="networkidle")  # the error toast gone
                else:
                    pytest.fail(f"Quick run failed 3 times in the UI; failed requests: {failed}")

                _wait("a flow run created by the Quick run button", flow_runs, 60, procs)
                page.screenshot(
                    path=str(ARTIFACTS / "ui-quick-run.png")
                )  # with the "scheduled" toast

                def finished():
                    runs_now = flow_runs()
                    assert len(runs_now) == 1, runs_now  # exactly the run the button started
                    if runs_now[0]["state_type"] in ("FAILED", "CRASHED", "CANCELLED"):
                        pytest.fail(
                            f"flow run {runs_now[0]['name']} ended {runs_now[0]['state_type']}:\n"
                            f"{serve_log.read_text()[-4000:]}"
                        )
                    return runs_now[0] if runs_now[0]["state_type"] == "COMPLETED" else None

                run = _wait("flow run started from the UI", finished, 300, procs)
                page.goto(
                    f"http://127.0.0.1:{port}/runs/flow-run/{run['id']}", wait_until="networkidle"
                )
                page.get_by_text("hero run done").first.wait_for(timeout=30_000)
                page.screenshot(path=str(ARTIFACTS / "ui-hero-run.png"), full_page=True)
            except BaseException:
                page.screenshot(path=str(ARTIFACTS / "ui-failure.png"), full_page=True)
                raise
            finally:
                browser.close()
    finally:
        if serve is not None:
            _stop(serve)
        _stop(server)

    # the run the browser started: one run of this deployment, every stage a cache hit
    summary = json.loads((runs / "smollm2-cpu" / "hero-run.json").read_text())
    assert {s: c["status"] for s, c in summary["stages"].items()} == {
        s: "cached" for s in TINY_STAGES
    }
    assert summary["server"] is None
    print(
        f"\nbrowser test: {time.monotonic() - started:.1f} s in all, {time.monotonic() - ui_started:.1f} s from "
        f"the UI's first page to a completed run ({run['total_run_time']:.2f} s of flow run time)"
    )
