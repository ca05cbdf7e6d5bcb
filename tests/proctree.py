"""Which processes a command left behind: found by session, never by command line.

Why: vLLM's EngineCore, its workers and its resource tracker do not carry ``--port N`` in their
command lines, so a test that looks for the port sees only the API server (issue 42). The pipeline
starts each server in a session (and process group) of its own (eagle3.serving.process), and vLLM's
children stay in it, re-parented to init or not. So: record the sessions of every descendant of
the command while it runs (``sessions``), then wait until no live process is left in any of them
(``wait_gone``). A process a survivor starts later lands in the same session and is counted too.
The test's own session is never counted (a command started without a session of its own).
It reads /proc itself, not through ``eagle3.serving.process.group_members``: a check must not share
the code it checks (a reader that finds nothing would make "nothing left" pass).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import NamedTuple


class Proc(NamedTuple):
    pid: int
    state: str
    ppid: int
    pgrp: int
    session: int


def processes() -> dict[int, Proc]:
    """Every process in /proc, read once (those that end while it reads are left out)."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # after the parenthesised command: state ppid pgrp session ...
        state, ppid, pgrp, session = stat.rsplit(")", 1)[1].split()[:4]
        out[int(entry)] = Proc(int(entry), state, int(ppid), int(pgrp), int(session))
    return out


def descendants(root: int) -> set[int]:
    """``root`` and every live process below it (by parent pid)."""
    procs = processes()
    found, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        for p in procs.values():
            if p.ppid == parent and p.pid not in found:
                found.add(p.pid)
                frontier.append(p.pid)
    return {pid for pid in found if pid in procs}


def sessions(root: int, own: bool = True) -> set[int]:
    """The sessions of ``root`` and its descendants (not the test's own); ``own=False`` leaves out
    ``root``'s session too (only those of the servers it started: a runner that stays up)."""
    procs = processes()
    skip = {os.getsid(0)} | (set() if own or root not in procs else {procs[root].session})
    return {procs[pid].session for pid in descendants(root) if pid in procs} - skip


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return "?"


def led_by(session_ids: set[int], marker: str) -> set[int]:
    """Those of these sessions whose leader's command line holds ``marker`` (a vLLM server's
    ``vllm.entrypoints``, not a Prefect runner's flow-run process)."""
    return {s for s in session_ids if marker in cmdline(s)}


def left(session_ids: set[int]) -> list[Proc]:
    """Live (non-zombie) processes in any of these sessions, this test's process excluded."""
    me = os.getpid()
    return [
        p
        for p in processes().values()
        if p.session in session_ids and p.state != "Z" and p.pid != me
    ]


def wait_gone(session_ids: set[int], timeout_s: float) -> list[Proc]:
    """Wait up to ``timeout_s`` for every process of these sessions to end; what is left."""
    deadline = time.monotonic() + timeout_s
    while (alive := left(session_ids)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive


def describe(alive: list[Proc]) -> str:
    return "\n".join(
        f"pid {p.pid} (session {p.session}, ppid {p.ppid}): {cmdline(p.pid)[:160]}" for p in alive
    )


def kill_sessions(session_ids: set[int]) -> None:
    """Cleanup after a failed test: SIGKILL every process left in these sessions."""
    import signal

    for p in left(session_ids):
        try:
            os.kill(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
