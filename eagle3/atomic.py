"""Atomic writes: a reader (or a rerun after ``kill -9``) sees the old file or the new one, never
half of one.

Every file a cache check or a resume trusts is written here: the data goes to a hidden
temporary name in the same folder, is flushed and fsynced, then ``os.replace`` puts it in place
(atomic on POSIX within one file system) and the folder is fsynced so the rename survives a power
cut. Hidden names (a leading dot) are what ``eagle3.artifacts`` leaves out of an artifact's file
listing, so a temporary left by a kill never counts as part of a finished stage.

The vLLM connector (``eagle3/extract/vllm_connector.py``) keeps its own two-line writer: it runs
inside the vLLM process and imports nothing of the pipeline.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_path(path: Path, suffix: str = ".tmp") -> Iterator[Path]:
    """Yield a temporary path next to ``path``; on success it replaces ``path``, on error it goes.

    For writers that want a file name (``safetensors``, ``savefig``): ``suffix`` keeps the
    extension a writer may look at (``.tmp.png``).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # pid in the name: two processes writing one file never share a temporary; a plain open
    # (not mkstemp) keeps the umask's permissions, which a vLLM unit of another user may need
    tmp = path.with_name(f".{path.name}.{os.getpid()}{suffix}")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_bytes_atomic(path: Path, data: bytes) -> None:
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_text_atomic(path: Path, text: str) -> None:
    write_bytes_atomic(path, text.encode("utf-8"))


def write_json_atomic(path: Path, data: Any) -> None:
    """JSON with indent 2 (manifests, markers, reports: read by people too)."""
    write_text_atomic(path, json.dumps(data, indent=2, ensure_ascii=False))


def replace_symlink(link: Path, target: str | Path) -> Path:
    """Point ``link`` at ``target`` (kept as given: relative stays relative), swapped atomically."""
    link = Path(link)
    link.parent.mkdir(parents=True, exist_ok=True)
    tmp = link.with_name(f".{link.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    os.symlink(target, tmp)
    os.replace(tmp, link)
    return link
