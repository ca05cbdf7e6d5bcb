"""Start (or attach to) the target's vLLM server and wait until it really serves.

    with start_server(cfg) as server:
        client = server.openai_client()

The returned ``Server`` is a context manager: leaving the block, by return, exception or
Ctrl-C, stops what this call started (and nothing it did not start).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3.config import PipelineConfig
from eagle3.serving.command import format_command, vllm_command
from eagle3.serving.process import ChildProcess, tail
from eagle3.serving.readiness import (
    PortInUseError,
    ServerError,
    free_port,
    port_is_free,
    root_url,
    wait_until_ready,
)
from eagle3.serving.systemd import SystemdUnit


@dataclass
class Server:
    base_url: str
    model: str
    backend: str
    started_here: bool
    ready_s: float = 0.0
    argv: list[str] | None = None
    log_path: Path | None = None
    pid: int | None = None
    api_key: str | None = field(default=None, repr=False)
    _stop: Callable[[], None] | None = field(default=None, repr=False)

    def stop(self) -> None:
        if self._stop is not None:
            stop, self._stop = self._stop, None
            stop()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def info(self) -> dict[str, Any]:
        """JSON-safe description (no api key) for manifests and artifacts."""
        return {
            "base_url": self.base_url,
            "model": self.model,
            "backend": self.backend,
            "started_here": self.started_here,
            "ready_s": round(self.ready_s, 2),
            "pid": self.pid,
            "log_path": str(self.log_path) if self.log_path else None,
        }

    def openai_client(self, timeout_s: float = 1800, max_retries: int = 0):
        """Async OpenAI client with an explicit timeout (the library's 600 s default kills long
        reasoning)."""
        import openai
        from openai import AsyncOpenAI

        return AsyncOpenAI(
            base_url=f"{self.base_url}/v1",
            api_key=self.api_key or "EMPTY",
            timeout=openai.Timeout(timeout_s, connect=30.0),
            max_retries=max_retries,
        )


def _looks_like_path(model: str) -> bool:
    return model.startswith(("/", "./", "../", "~")) or Path(model).exists()


def check_model_path(model: str) -> None:
    """Fail in milliseconds, not after vLLM's import time, when a local model folder is wrong."""
    if not _looks_like_path(model):
        return  # a hub id: vLLM resolves it, and an early death is reported with its log
    p = Path(model).expanduser()
    if not p.exists():
        raise ServerError(f"model path {p} does not exist")
    if p.is_dir() and not (p / "config.json").is_file():
        raise ServerError(f"model path {p} has no config.json: not a Hugging Face model folder")


def check_executable(path: str) -> None:
    if os.sep in path and not os.access(path, os.X_OK):
        raise ServerError(
            f"vLLM interpreter {path} not found or not executable: create the serving "
            "environment with `make vllm-env` (deploy/setup_vllm_env.sh)"
        )


def start_server(
    cfg: PipelineConfig,
    model: str,
    *,
    log_dir: Path | None = None,
    speculative_config: dict[str, Any] | None = None,
    ready_timeout_s: float | None = None,
) -> Server:
    """Start the target's server with the configured backend and block until it is ready."""
    timeout = ready_timeout_s or cfg.serve.ready_timeout_s
    if cfg.serve.backend == "external":
        return _attach_external(cfg, timeout)
    if cfg.serve.backend == "systemd":
        return _start_systemd(cfg, timeout)
    return _start_process(cfg, model, log_dir, speculative_config, timeout)


def _attach_external(cfg: PipelineConfig, timeout: float) -> Server:
    """A server started elsewhere: only wait until it serves; never stopped from here."""
    s = cfg.serve
    name = cfg.target.served_model_name
    base_url = root_url(s.base_url)
    ready = wait_until_ready(
        base_url,
        name,
        timeout_s=timeout,
        poll_interval_s=s.poll_interval_s,
        check_alive=lambda: None,
        api_key=s.api_key,
        say_waiting=True,
    )
    return Server(base_url, name, "external", started_here=False, ready_s=ready, api_key=s.api_key)


def _start_systemd(cfg: PipelineConfig, timeout: float) -> Server:
    """Start the systemd unit (stopped again if it never gets ready)."""
    s = cfg.serve
    name = cfg.target.served_model_name
    unit = SystemdUnit(s.unit)
    base_url = f"http://{s.host}:{s.port}"
    unit.start()
    try:
        ready = wait_until_ready(
            base_url,
            name,
            timeout_s=timeout,
            poll_interval_s=s.poll_interval_s,
            check_alive=unit.check_alive,
            api_key=s.api_key,
        )
    except BaseException:
        unit.stop()
        raise
    return Server(
        base_url,
        name,
        "systemd",
        started_here=unit.started_here,
        ready_s=ready,
        api_key=s.api_key,
        _stop=unit.stop,
    )


def _process_command(
    cfg: PipelineConfig, model: str, speculative_config: dict[str, Any] | None
) -> tuple[int, list[str]]:
    """The port (checked free) and the vLLM command line of a server started here."""
    s = cfg.serve
    check_model_path(model)
    port = s.port or free_port(s.host)
    if not port_is_free(s.host, port):
        raise PortInUseError(
            f"port {port} on {s.host} is already in use: stop what holds it or set serve.port"
        )
    argv = vllm_command(
        s,
        model,
        cfg.target.served_model_name,
        port=port,
        trust_remote_code=cfg.target.trust_remote_code,
        speculative_config=speculative_config,
    )
    if s.entrypoint == "module":
        check_executable(argv[0])
    return port, argv


# A server stopped before it was ready gets this long after SIGTERM before SIGKILL: vLLM does
# not act on SIGTERM while it loads, and the full serve.stop_timeout_s (60 s) was waited in
# silence after a Ctrl-C (issue #30). Nothing of a loading server is worth a clean shutdown.
LOADING_STOP_S = 5.0


def stop_loading(child: ChildProcess, stop_timeout_s: float) -> None:
    """Stop a server that never got ready (interrupted, timed out or dead), saying so."""
    if child.running():
        grace = min(stop_timeout_s, LOADING_STOP_S)
        print(
            f"stopping the vLLM server (pid {child.pid}) that was still loading: SIGTERM, then "
            f"SIGKILL after {grace:.0f} s",
            file=sys.stderr,
            flush=True,
        )
        child.stop(timeout_s=grace)
    else:
        child.stop(timeout_s=stop_timeout_s)


def _start_process(
    cfg: PipelineConfig,
    model: str,
    log_dir: Path | None,
    speculative_config: dict[str, Any] | None,
    timeout: float,
) -> Server:
    """Start vLLM as a child process logging to ``log_dir`` (stopped if it never gets ready)."""
    s = cfg.serve
    name = cfg.target.served_model_name
    port, argv = _process_command(cfg, model, speculative_config)
    env = dict(s.env)
    if s.api_key:
        env["VLLM_API_KEY"] = s.api_key  # not on the command line, so never in ps or logs
    log_dir = Path(log_dir or cfg.paths.stage_dir("serve"))
    log_path = log_dir / f"vllm-{port}-{time.strftime('%Y%m%d-%H%M%S')}.log"
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path.write_text(f"$ {format_command(argv, s.env)}\n")
    child = ChildProcess(argv, log_path, env=env)
    base_url = f"http://{s.host}:{port}"
    try:
        ready = wait_until_ready(
            base_url,
            name,
            timeout_s=timeout,
            poll_interval_s=s.poll_interval_s,
            check_alive=child.check_alive,
            api_key=s.api_key,
            describe=lambda: f"\n--- last lines of {log_path} ---\n{tail(log_path)}",
        )
    except BaseException:
        stop_loading(child, s.stop_timeout_s)
        raise
    return Server(
        base_url,
        name,
        "process",
        started_here=True,
        ready_s=ready,
        argv=argv,
        log_path=log_path,
        pid=child.pid,
        api_key=s.api_key,
        _stop=lambda: child.stop(timeout_s=s.stop_timeout_s),
    )
