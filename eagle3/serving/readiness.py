"""Readiness and liveness checks shared by every serve backend.

vLLM's ``/health`` answers 200 as soon as the engine loop is up, but the model list (and
so chat requests) can lag behind it; "ready" therefore means both ``/health`` and
``/v1/models`` answer, and the expected model is listed.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

import httpx


class ServerError(RuntimeError):
    """The server could not be started or reached; the message says why."""


class PortInUseError(ServerError):
    pass


class ServerDiedError(ServerError):
    pass


class ServerTimeoutError(ServerError):
    pass


def port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def probe(base_url: str, model: str | None, api_key: str | None = None, timeout: float = 5.0) -> str | None:
    """None if ready, else a short reason (for the timeout message)."""
    try:
        with httpx.Client(timeout=timeout, headers=auth_headers(api_key)) as c:
            h = c.get(f"{base_url}/health")
            if h.status_code != 200:
                return f"/health answered {h.status_code}"
            m = c.get(f"{base_url}/v1/models")
            if m.status_code != 200:
                return f"/v1/models answered {m.status_code}"
            ids = [d.get("id") for d in m.json().get("data", [])]
    except httpx.HTTPError as e:
        return f"{type(e).__name__}: {e}"
    except ValueError as e:
        return f"/v1/models did not answer JSON: {e}"
    if model is not None and model not in ids:
        return f"model {model!r} not served (served: {ids})"
    return None


def wait_until_ready(
    base_url: str,
    model: str | None,
    *,
    timeout_s: float,
    poll_interval_s: float,
    check_alive: Callable[[], None],
    api_key: str | None = None,
    describe: Callable[[], str] = lambda: "",
) -> float:
    """Poll until ready; returns seconds waited.

    ``check_alive`` raises ServerDiedError as soon as the server is known dead, so an early
    crash is reported at once with its cause instead of after the full timeout.
    """
    t0 = time.monotonic()
    reason = "not polled yet"
    while True:
        check_alive()
        reason = probe(base_url, model, api_key) or ""
        if not reason:
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout_s:
            raise ServerTimeoutError(
                f"server at {base_url} not ready after {timeout_s:.0f} s (last check: {reason}){describe()}"
            )
        time.sleep(poll_interval_s)
