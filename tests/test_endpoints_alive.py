"""Generate's dead-server check (``endpoints_alive``): a server that refuses connections or
answers an error is gone at once; one that times out is asked again before the run stops.

The busy server here is a test double (a plain HTTP handler that does not answer its first
request until the test ends): a vLLM server too busy to answer /health in time happened on a
2-core machine at load average 30 and cannot be reproduced on demand; the real server's death
is tests/test_generate_vllm.py's. The waits between rounds are recorded, not slept."""

from __future__ import annotations

import asyncio
import socket
import threading
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from eagle3.generate import client
from eagle3.generate.client import Endpoint, EndpointPool, endpoints_alive


@pytest.fixture
def waits(monkeypatch) -> list[float]:
    """The seconds endpoints_alive waited between rounds (client's asyncio.sleep, recorded)."""
    got: list[float] = []

    async def sleep(s: float) -> None:
        got.append(s)

    monkeypatch.setattr(
        client, "asyncio", types.SimpleNamespace(**{**vars(asyncio), "sleep": sleep})
    )
    return got


@pytest.fixture
def serve():
    """serve(status, busy_first): an HTTP server whose /health answers ``status``; with
    ``busy_first`` its first request gets no answer until the test ends (the client times out)."""
    started, release = [], threading.Event()

    def start(status: int, busy_first: bool = False) -> tuple[str, list[int]]:
        seen: list[int] = []

        class Health(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                seen.append(len(seen))
                if busy_first and len(seen) == 1:
                    release.wait(60)
                self.send_response(status)
                self.end_headers()

            def log_message(self, *args):
                pass

        srv = ThreadingHTTPServer(("127.0.0.1", 0), Health)
        srv.daemon_threads = True
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        started.append(srv)
        return f"http://127.0.0.1:{srv.server_address[1]}", seen

    yield start
    release.set()
    for srv in started:
        srv.shutdown()
        srv.server_close()


def pool(*urls: str) -> EndpointPool:
    return EndpointPool([Endpoint(u, client=None) for u in urls])  # no chat requests here


def alive(p: EndpointPool, tries: int) -> bool:
    return asyncio.run(endpoints_alive(p, None, timeout_s=0.5, tries=tries, wait_s=5.0))


def refused_url() -> str:
    """A port nothing listens on (bound, then closed): a connection is refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_a_server_too_busy_to_answer_once_is_still_alive(serve, waits):
    url, seen = serve(200, busy_first=True)
    assert alive(pool(url + "/v1"), tries=3) is True
    assert len(seen) == 2 and waits == [5.0]  # timed out, waited a round, then answered


def test_one_round_only_was_the_old_false_alarm(serve, waits):
    url, _ = serve(200, busy_first=True)
    assert alive(pool(url), tries=1) is False and waits == []


@pytest.mark.parametrize("status", [None, 503])
def test_a_dead_server_is_gone_at_once(serve, waits, status):
    """Connection refused (no server on the port), or an error status: no second round."""
    if status is None:
        url, seen = refused_url(), None
    else:
        url, seen = serve(status)
    assert alive(pool(url), tries=4) is False
    assert waits == [] and (seen is None or len(seen) == 1)


def test_any_live_endpoint_is_enough(serve, waits):
    url, _ = serve(200)
    assert alive(pool(refused_url(), url), tries=1) is True
