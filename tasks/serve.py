"""Prefect tasks for the serve stage: start and stop the target's vLLM server.

The server outlives the task that starts it (generate uses it), so the flow owns its lifetime:
it starts one only when some stage has work for it (``LazyServer``) and stops it in a
``finally`` block, which also runs on cancellation (Prefect turns the runner's SIGTERM into an
exception in the flow). As a last resort for a flow process that died without unwinding, every
server a run starts is recorded in ``<run dir>/serve/servers.json``; the flow's failure, crash
and cancellation hooks stop what is still listed there. Nothing here is cached: a server is a
process, not an artifact.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from eagle3.atomic import write_json_atomic
from eagle3.config import PipelineConfig
from eagle3.serving.client import ChatResult, chat
from eagle3.serving.server import Server, start_server
from tasks.retries import TIMEOUT_S

REGISTRY = "servers.json"


def _registry(cfg: PipelineConfig) -> Path:
    return cfg.paths.stage_root("serve") / REGISTRY


def _read(path: Path) -> list[dict[str, Any]]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return []


def record_server(cfg: PipelineConfig, server: Server) -> None:
    """Remember a server this run started (process group or systemd unit) until it is stopped."""
    if not server.started_here:
        return
    path = _registry(cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    from prefect.runtime import flow_run

    entry = {
        "backend": server.backend,
        "pid": server.pid,
        "unit": cfg.serve.unit if server.backend == "systemd" else None,
        "base_url": server.base_url,
        "started": time.time(),
        "flow_run_id": str(flow_run.id or ""),
    }
    write_json_atomic(path, [*_read(path), entry])


def forget_server(cfg: PipelineConfig, server: Server) -> None:
    path = _registry(cfg)
    if path.exists():
        write_json_atomic(
            path,
            [
                e
                for e in _read(path)
                if not (e.get("pid") == server.pid and e.get("base_url") == server.base_url)
            ],
        )


def stop_recorded_servers(
    cfg: PipelineConfig, flow_run_id: str | None = None, grace_s: float = 30
) -> list[str]:
    """Stop the servers still listed for this run dir (those of ``flow_run_id`` only, if given).

    Used by the hooks after a crash or a cancellation, when the flow process may be gone and the
    ``Server`` objects with it. A process server is its own process group (pgid == pid).
    """
    from eagle3.serving.process import group_members

    path = _registry(cfg)
    stopped = []
    entries = _read(path)
    mine = [e for e in entries if flow_run_id is None or e.get("flow_run_id") == flow_run_id]
    for e in mine:
        if e.get("backend") == "process" and e.get("pid"):
            pgid = int(e["pid"])
            if group_members(pgid):
                try:
                    os.killpg(pgid, signal.SIGTERM)
                    deadline = time.monotonic() + grace_s
                    while group_members(pgid) and time.monotonic() < deadline:
                        time.sleep(0.2)
                    if group_members(pgid):
                        os.killpg(pgid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                stopped.append(f"process group {pgid} ({e.get('base_url')})")
        elif e.get("backend") == "systemd" and e.get("unit"):
            subprocess.run(
                ["systemctl", "stop", e["unit"]], capture_output=True, text=True, check=False
            )
            stopped.append(f"systemd unit {e['unit']}")
    if path.exists():
        write_json_atomic(path, [e for e in entries if e not in mine])
    return stopped


@task(
    name="serve",
    retries=1,
    retry_delay_seconds=10,
    cache_policy=NO_CACHE,
    persist_result=False,
    timeout_seconds=TIMEOUT_S["serve"],
)
def start_server_task(cfg: PipelineConfig, model: str) -> Server:
    logger = get_run_logger()
    logger.info("starting %s server for %s", cfg.serve.backend, model)
    server = start_server(cfg, model)
    record_server(cfg, server)
    logger.info("ready in %.1f s at %s", server.ready_s, server.base_url)
    create_markdown_artifact(
        key="serve",
        markdown="| field | value |\n|---|---|\n"
        + "\n".join(f"| {k} | {v} |" for k, v in server.info().items()),
        description="vLLM server of this run",
    )
    return server


@task(name="stop-server", cache_policy=NO_CACHE, persist_result=False)
def stop_server_task(cfg: PipelineConfig, server: Server) -> None:
    server.stop()
    forget_server(cfg, server)


@task(
    name="smoke-chat", retries=2, retry_delay_seconds=5, cache_policy=NO_CACHE, persist_result=False
)
def smoke_chat_task(server: Server, prompt: str) -> ChatResult:
    """One chat request with exact token ids: the served model really answers."""
    result = chat(server.base_url, server.model, prompt, api_key=server.api_key)
    if not result.completion_token_ids:
        raise RuntimeError(
            "server answered without token ids: is this vLLM with return_token_ids support?"
        )
    get_run_logger().info(
        "answer: %r (%d tokens)", result.content, len(result.completion_token_ids)
    )
    return result


class LazyServer:
    """The run's target server, started on first use (a fully cached run starts none)."""

    SMOKE_PROMPT = "What is the capital of France? Answer in one sentence."

    def __init__(self, cfg: PipelineConfig, model: str):
        self.cfg, self.model = cfg, model
        self.server: Server | None = None
        self.smoke: ChatResult | None = None

    def base_urls(self) -> list[str]:
        if self.server is None:
            self.server = start_server_task(self.cfg, self.model)
            self.smoke = smoke_chat_task(self.server, self.SMOKE_PROMPT)
        return [self.server.base_url, *self.cfg.generate.endpoints]

    def stop(self) -> None:
        if self.server is not None:
            stop_server_task(self.cfg, self.server)

    def info(self) -> dict[str, Any] | None:
        return self.server.info() if self.server else None
