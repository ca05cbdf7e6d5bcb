"""Generate's dead-server check (``endpoints_alive``): a server that refuses connections or
answers an error is gone at once; one that times out is asked again before the run stops.

The slow server here is a test double (a plain HTTP handler that sleeps): a vLLM server too busy
to answer /health in time happened on a 2-core machine at load average 30 and cannot be
reproduced on demand; the real server's death is tests/test_generate_vllm.py's."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from eagle3.generate.client import Endpoint, EndpointPool, endpoints_alive


def serve(status: int, slow_first: float) -> tuple[ThreadingHTTPServer, list[float]]:
    """An HTTP server whose /health answers ``status``, the first time after ``slow_first`` s."""
    seen: list[float] = []

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            seen.append(time.monotonic())
            if len(seen) == 1:
                time.sleep(slow_first)
            self.send_response(status)
            self.end_headers()

        def log_message(self, *args):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, seen


def pool(*urls: str) -> EndpointPool:
    return EndpointPool([Endpoint(u, client=None) for u in urls])  # no chat requests here


def alive(p: EndpointPool, tries: int) -> tuple[bool, float]:
    t0 = time.monotonic()
    ok = asyncio.run(endpoints_alive(p, None, timeout_s=0.5, tries=tries, wait_s=0.2))
    return ok, time.monotonic() - t0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_server_too_busy_to_answer_once_is_still_alive():
    srv, seen = serve(200, slow_first=1.5)
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}/v1"
        assert alive(pool(url), tries=3)[0] is True
        assert len(seen) == 2  # the timed-out probe, then the one that answered
    finally:
        srv.shutdown()


def test_one_round_only_was_the_old_false_alarm():
    srv, _ = serve(200, slow_first=1.5)
    try:
        assert alive(pool(f"http://127.0.0.1:{srv.server_address[1]}"), tries=1)[0] is False
    finally:
        srv.shutdown()


@pytest.mark.parametrize("status", [None, 503])
def test_a_dead_server_is_gone_at_once(status):
    """Connection refused (no server on the port), or an error status: no second round."""
    srv = None
    if status is None:
        url = f"http://127.0.0.1:{free_port()}"
    else:
        srv, seen = serve(status, slow_first=0)
        url = f"http://127.0.0.1:{srv.server_address[1]}"
    try:
        ok, took = alive(pool(url), tries=4)
        assert ok is False and took < 0.2  # four rounds with waits would be >= 0.6 s
        if srv is not None:
            assert len(seen) == 1
    finally:
        if srv is not None:
            srv.shutdown()


def test_any_live_endpoint_is_enough():
    srv, _ = serve(200, slow_first=0)
    try:
        dead = f"http://127.0.0.1:{free_port()}"
        assert alive(pool(dead, f"http://127.0.0.1:{srv.server_address[1]}"), tries=1)[0] is True
    finally:
        srv.shutdown()
