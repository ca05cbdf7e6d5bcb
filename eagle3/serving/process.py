"""The `process` backend: vLLM as a child process in its own process group.

vLLM forks an EngineCore and workers; they share the group of the API server we start
with ``start_new_session=True``, so stopping signals the whole group (SIGTERM, then SIGKILL)
and no engine process outlives the pipeline. Live servers are also stopped at interpreter
exit, which covers Ctrl-C and failing tests; SIGTERM is turned into an exception by the CLI
(eagle3.signals) so the same cleanup runs. Against ``kill -9`` of the pipeline, which runs no
cleanup at all, the server asks Linux for SIGTERM when its parent dies (PR_SET_PDEATHSIG):
vLLM then shuts its engine down itself instead of living on, re-parented to init.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import subprocess
import sys
import time
import weakref
from pathlib import Path

from eagle3.serving.readiness import ServerDiedError, ServerError


def tail(path: Path, n: int = 40) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64_000))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(lines[-n:])


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of a process group, read from /proc."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # Fields after the parenthesised command: state ppid pgrp ...
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(entry))
    return pids


_live: weakref.WeakSet[ChildProcess] = weakref.WeakSet()
PR_SET_PDEATHSIG = 1
# Resolved here, not in the child: between fork and exec only this call may run (no imports,
# no locks).
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the parent dies, however it dies."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


@atexit.register
def _stop_all() -> None:
    for proc in list(_live):
        proc.stop(timeout_s=10)


class ChildProcess:
    """A command run in its own process group with its output in a log file."""

    def __init__(self, argv: list[str], log_path: Path, env: dict[str, str] | None = None):
        self.argv = argv
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        full_env = {**os.environ, **(env or {})}
        log = open(self.log_path, "ab")
        try:
            self.popen = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=full_env,
                start_new_session=True,
                preexec_fn=_die_with_parent if _prctl is not None else None,
            )
        except OSError as e:
            raise ServerError(f"cannot start {argv[0]!r}: {e.strerror}") from None
        finally:
            log.close()
        self.pid = self.popen.pid
        self.pgid = self.pid  # start_new_session makes the child its own group leader
        _live.add(self)

    def check_alive(self) -> None:
        code = self.popen.poll()
        if code is not None:
            _live.discard(self)
            self._reap_group(grace_s=2)
            raise ServerDiedError(
                f"server process exited with code {code} before it was ready.\n"
                f"--- last lines of {self.log_path} ---\n{tail(self.log_path)}"
            )

    def running(self) -> bool:
        return self.popen.poll() is None

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.pgid, sig)
        except ProcessLookupError:
            pass

    def _reap_group(self, grace_s: float) -> None:
        deadline = time.monotonic() + grace_s
        while group_members(self.pgid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if group_members(self.pgid):
            self._signal_group(signal.SIGKILL)
            deadline = time.monotonic() + 10
            while group_members(self.pgid) and time.monotonic() < deadline:
                time.sleep(0.1)

    def stop(self, timeout_s: float = 60) -> int | None:
        """SIGTERM the whole group, SIGKILL what is left after ``timeout_s``. Idempotent."""
        _live.discard(self)
        if self.popen.poll() is None or group_members(self.pgid):
            self._signal_group(signal.SIGTERM)
            try:
                self.popen.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                self.popen.wait(timeout=10)
            self._reap_group(grace_s=min(timeout_s, 15))
        return self.popen.returncode
