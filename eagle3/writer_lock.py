"""One writer per stage folder: an exclusive lock held for the whole run of a stage.

Why: two ``eagle3 generate`` runs with the same ``--out`` (or two runs of one profile, which share
their keyed folders: a nightly regeneration overlapping a run started from the UI) left 250
records for 200 prompts; one sealed the folder, the other died, and the folder stayed stuck
(issue #39). Now the second writer fails at once, naming the first.

How: ``fcntl.flock`` on ``<folder>/.writer.lock`` (a hidden name: ``eagle3.artifacts`` leaves it
out of an artifact's file listing). The kernel releases the lock when its holder exits, however
it exits (``kill -9`` included), so a lock left by a dead process is simply free: the next writer
takes it and says whose it was. The lock file holds the holder's pid, host, start time and
command while it is held, and is emptied on release; a non-empty file found free means its holder
died. Within one process the lock is re-entrant for the thread that holds it: the CLI takes it
before it starts a server, and ``eagle3.stages.run_stage`` takes it again around the stage.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from eagle3.errors import FolderBusy, OutputDirError

log = logging.getLogger(__name__)

LOCK_NAME = ".writer.lock"


@dataclass
class _Held:
    fd: int
    thread: int
    depth: int = 1


_held: dict[str, _Held] = {}
_guard = threading.Lock()


def check_output_dir(path: Path, what: str = "output folder") -> Path:
    """Make sure ``path`` is (or can be created as) a writable folder; one clear error if not.
    Creates nothing, so a command can check it before anything else and leave no trace.

    Before: ``--out`` naming an existing file or a read-only place ended in a 50-110-line
    traceback, some of them after the server had loaded (issue #39)."""
    path = Path(path)
    place = "choose a writable place (--out, or paths.runs_dir in the profile)"
    if path.exists() and not path.is_dir():
        raise OutputDirError(
            f"{what} {path} is an existing file, not a folder: name a folder (it is created if "
            "missing), e.g. another --out"
        )
    existing = next((p for p in (path, *path.parents) if p.exists()), Path("/"))
    if not existing.is_dir():
        raise OutputDirError(f"cannot create the {what} {path}: {existing} is a file; {place}")
    if not os.access(existing, os.W_OK | os.X_OK) or _read_only_fs(existing):
        why = "read-only file system" if _read_only_fs(existing) else "no write permission"
        raise OutputDirError(f"cannot write the {what} {path} ({existing}: {why}): {place}")
    return path


def _read_only_fs(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _make_dir(path: Path, what: str = "output folder") -> Path:
    path = check_output_dir(path, what)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputDirError(
            f"cannot create the {what} {path} ({e.strerror or e}): choose a writable place "
            "(--out, or paths.runs_dir in the profile)"
        ) from None
    return path


def _holder_text(info: dict) -> str:
    return (
        f"pid {info.get('pid')} on {info.get('host')} since {info.get('started')} "
        f"({info.get('command')})"
    )


def read_holder(folder: Path) -> dict | None:
    """What the lock file of ``folder`` says of its holder (None: empty or unreadable)."""
    try:
        text = (Path(folder) / LOCK_NAME).read_text()
        return json.loads(text) if text.strip() else None
    except (OSError, ValueError):
        return None


def holder_of(folder: Path) -> dict | None:
    """The process that holds ``folder``'s writer lock now, or None if it is free (or held by
    this process). For checks before a destructive step (the flow clearing a folder)."""
    folder = Path(folder)
    lock = folder / LOCK_NAME
    if not lock.is_file() or str(folder.resolve()) in _held:
        return None
    try:
        fd = os.open(lock, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return read_holder(folder) or {"pid": "?", "host": "?", "started": "?", "command": "?"}
    finally:
        os.close(fd)  # closing releases a lock we took
    return None


def refuse_if_held(folder: Path, stage: str = "") -> None:
    """Raise FolderBusy if another process holds ``folder``'s writer lock: for a step that must
    not touch a folder someone writes (the flow clearing a forced stage's folder)."""
    if holder_of(folder) is not None:
        raise _busy(Path(folder), stage)


def _busy(folder: Path, stage: str) -> FolderBusy:
    info = read_holder(folder)
    who = _holder_text(info) if info else "another process (it has not written its name yet)"
    what = f"another {stage} run" if stage else "another run"
    return FolderBusy(
        f"{folder} is being written by {what}: {who}. One writer per folder: wait for it to "
        "finish (or stop it), then rerun; or write elsewhere (--out)"
    )


@contextlib.contextmanager
def writer_lock(folder: Path, stage: str = "") -> Iterator[Path]:
    """Hold ``folder``'s writer lock for the block (the folder is created and checked first).

    Raises FolderBusy at once if another process (or another thread of this one) holds it;
    re-entrant for the thread that holds it."""
    folder = _make_dir(folder)
    key = str(folder.resolve())
    me = threading.get_ident()
    with _guard:
        held = _held.get(key)
        if held is not None:
            if held.thread != me:
                raise _busy(folder, stage)
            held.depth += 1
    if held is not None:
        try:
            yield folder
        finally:
            with _guard:
                held.depth -= 1
        return
    fd = _acquire(folder, stage)
    with _guard:
        _held[key] = _Held(fd, me)
    try:
        yield folder
    finally:
        with _guard:
            del _held[key]
        _release(fd)


def _acquire(folder: Path, stage: str) -> int:
    lock = folder / LOCK_NAME
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise OutputDirError(
            f"cannot write in the output folder {folder} ({e.strerror or e}): choose a writable "
            "place (--out, or paths.runs_dir in the profile)"
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise _busy(folder, stage) from None
    previous = read_holder(folder)
    if previous:  # free but not emptied: its holder died without releasing it
        log.warning(
            "%s: took over the writer lock of %s, which ended without releasing it (killed?)",
            folder,
            _holder_text(previous),
        )
    info = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": " ".join(sys.argv)[:300],
        "stage": stage,
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(info).encode(), 0)
    return fd


def _release(fd: int) -> None:
    try:
        os.ftruncate(fd, 0)  # empty: the next writer knows this one finished
    except OSError:
        pass
    os.close(fd)
