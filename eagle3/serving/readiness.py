"""Readiness and liveness checks shared by every serve backend.

vLLM's ``/health`` answers 200 as soon as the engine loop is up, but the model list (and
so chat requests) can lag behind it; "ready" therefore means both ``/health`` and
``/v1/models`` answer, and the expected model is listed.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable

import httpx

from eagle3.errors import EndpointError, ServerError

log = logging.getLogger(__name__)
#: after this long, and as often again, a wait says what it waits for (a wrong URL shows at once)
SAY_EVERY_S = 15.0


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


def root_url(base_url: str) -> str:
    """The server's root: ``http://h:p``, ``http://h:p/`` and ``http://h:p/v1`` (the OpenAI
    convention) all mean the same server; ``/health`` lives at the root, the API under ``/v1``."""
    url = base_url.strip().rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


# Statuses that no amount of waiting fixes: a wrong path (404), a wrong or missing key (401/403).
FATAL_PROBE_STATUS = {401, 403, 404}


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _fatal(url: str, status: int) -> EndpointError:
    what = (
        "the key (serve.api_key)"
        if status in (401, 403)
        else "the URL (serve.base_url / --base-url: the server's root)"
    )
    return EndpointError(
        f"{url} answered {status}: this is not a vLLM server's route or the key is wrong; check "
        f"{what} and rerun"
    )


def probe(
    base_url: str, model: str | None, api_key: str | None = None, timeout: float = 5.0
) -> str | None:
    """None if ready, else a short reason (for the timeout message). Raises EndpointError on a
    404/401/403, or a model list without ``model``, which waiting cannot fix (a wrong path or a
    wrong served name used to wait out the whole ready timeout: 600 s in the shipped profile)."""
    base_url = root_url(base_url)
    try:
        with httpx.Client(timeout=timeout, headers=auth_headers(api_key)) as c:
            h = c.get(f"{base_url}/health")
            if h.status_code in FATAL_PROBE_STATUS - {401, 403}:  # vLLM's /health takes no key
                raise _fatal(f"{base_url}/health", h.status_code)
            if h.status_code != 200:
                return f"/health answered {h.status_code}"
            m = c.get(f"{base_url}/v1/models")
            if m.status_code in FATAL_PROBE_STATUS:
                raise _fatal(f"{base_url}/v1/models", m.status_code)
            if m.status_code != 200:
                return f"/v1/models answered {m.status_code}"
            ids = [d.get("id") for d in m.json().get("data", [])]
    except httpx.HTTPError as e:
        return f"{type(e).__name__}: {e}"
    except ValueError as e:
        return f"/v1/models did not answer JSON: {e}"
    if model is not None and model not in ids:
        if ids:  # a server that lists other models will not start serving this one by waiting
            raise EndpointError(
                f"{base_url}/v1/models does not list {model!r} (it serves {ids}): set "
                "target.served_model_name to the served name, then rerun"
            )
        return f"model {model!r} not served yet (the list is empty)"
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
    say_waiting: bool = False,
) -> float:
    """Poll until ready; returns seconds waited. ``say_waiting``: log every ``SAY_EVERY_S`` what
    it waits for (a server started elsewhere, whose URL may be wrong; one started here is loading,
    and its death is caught by ``check_alive``).

    ``check_alive`` raises ServerDiedError as soon as the server is known dead, so an early
    crash is reported at once with its cause instead of after the full timeout.
    """
    t0 = time.monotonic()
    reason = "not polled yet"
    say_at = SAY_EVERY_S
    while True:
        check_alive()
        reason = probe(base_url, model, api_key) or ""
        if not reason:
            return time.monotonic() - t0
        waited = time.monotonic() - t0
        if waited > timeout_s:
            raise ServerTimeoutError(
                f"server at {base_url} not ready after {timeout_s:.0f} s "
                f"(last check: {reason}){describe()}"
            )
        if say_waiting and waited >= say_at:  # a silent wait of the timeout hides a wrong URL
            log.warning(
                "waiting for the server at %s: %s (%.0f s of serve.ready_timeout_s %.0f s)",
                base_url,
                reason,
                waited,
                timeout_s,
            )
            say_at += SAY_EVERY_S
        time.sleep(poll_interval_s)
