"""Append-only sample shards that survive `kill -9` at any moment.

Layout of a generate output folder:
  samples-00000.jsonl          complete shards (renamed into place when full: atomic rotation)
  samples-00001.jsonl.open     the shard being appended to
  errors.jsonl                 one line per skipped or failed sample, with its reason
  manifest.json                written atomically at the end of a run

Each record is one JSON line written with a single write and flushed; a kill can only leave
a torn last line in the `.open` shard (or in errors.jsonl), which ``open`` detects and cuts
off before appending again. Ids of every complete record are the resume set: a rerun skips
them, so no sample is lost or duplicated.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

OPEN_SUFFIX = ".open"
PERMANENT = {"rejected", "skipped"}  # the prompt is the problem; "failed" (the server was) is retried on rerun


def _error_key(e: dict[str, Any]) -> tuple:
    return (e.get("id"), str(e.get("source")), e.get("kind"), e.get("reason"))


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2, ensure_ascii=False)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
    fsync_dir(path.parent)


def repair_jsonl(path: Path) -> tuple[list[dict[str, Any]], int]:
    """Complete records of a jsonl file; a torn tail (kill mid-write) is truncated away.

    Returns (records, bytes dropped).
    """
    data = path.read_bytes()
    records: list[dict[str, Any]] = []
    good_end = 0
    pos = 0
    while pos < len(data):
        nl = data.find(b"\n", pos)
        if nl < 0:
            break  # no newline: the last write was cut
        try:
            records.append(json.loads(data[pos:nl]))
        except (json.JSONDecodeError, UnicodeDecodeError):
            break  # a torn record followed by a later write cannot happen; stop at the first bad line
        good_end = pos = nl + 1
    dropped = len(data) - good_end
    if dropped:
        with open(path, "r+b") as f:
            f.truncate(good_end)
            f.flush()
            os.fsync(f.fileno())
    return records, dropped


class JsonlAppender:
    """One JSON record per line, one write per record, flushed; fsync every ``sync_every``."""

    def __init__(self, path: Path, sync_every: int = 64):
        self.path = path
        self.f = open(path, "ab")
        self.sync_every = sync_every
        self._since_sync = 0

    def append(self, record: dict[str, Any]) -> None:
        self.f.write(json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n")
        self.f.flush()
        self._since_sync += 1
        if self._since_sync >= self.sync_every:
            self.sync()

    def sync(self) -> None:
        self.f.flush()
        os.fsync(self.f.fileno())
        self._since_sync = 0

    def close(self) -> None:
        if not self.f.closed:
            self.sync()
            self.f.close()


class ShardStore:
    """Sample shards + errors file of one generate output folder."""

    def __init__(self, root: Path, shard_size: int = 1000):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.shard_size = shard_size
        self.torn_bytes = 0
        self.done_ids: set[str] = set()
        complete = sorted(self.root.glob("samples-*.jsonl"))
        for shard in complete:
            records, dropped = repair_jsonl(shard)
            self.torn_bytes += dropped
            self.done_ids.update(r["id"] for r in records)
        open_shards = sorted(self.root.glob(f"samples-*.jsonl{OPEN_SUFFIX}"))
        if len(open_shards) > 1:
            raise RuntimeError(f"{self.root}: more than one open shard {open_shards}; the folder was edited by hand")
        self.errors_path = self.root / "errors.jsonl"
        self._error_keys: set[tuple] = set()
        self.permanent_ids: set[str] = set()  # latest error says the prompt itself is the problem
        if self.errors_path.exists():
            errors, dropped = repair_jsonl(self.errors_path)
            self.torn_bytes += dropped
            for e in errors:
                self._error_keys.add(_error_key(e))
                if e.get("id"):
                    (self.permanent_ids.add if e["kind"] in PERMANENT else self.permanent_ids.discard)(e["id"])
        if open_shards:
            self._open_path = open_shards[0]
            records, dropped = repair_jsonl(self._open_path)
            self.torn_bytes += dropped
            self.done_ids.update(r["id"] for r in records)
            self._count = len(records)
            self._index = int(self._open_path.name.split("-")[1].split(".")[0])
        else:
            self._index = len(complete)
            self._open_path = self._shard_path(self._index, open_=True)
            self._count = 0
        self._writer = JsonlAppender(self._open_path)
        self._errors = JsonlAppender(self.errors_path)

    def _shard_path(self, index: int, open_: bool = False) -> Path:
        return self.root / f"samples-{index:05d}.jsonl{OPEN_SUFFIX if open_ else ''}"

    def add(self, record: dict[str, Any]) -> None:
        if record["id"] in self.done_ids:
            return  # never write a sample twice
        self._writer.append(record)
        self.done_ids.add(record["id"])
        self._count += 1
        if self._count >= self.shard_size:
            self._rotate()

    def add_error(self, record: dict[str, Any]) -> None:
        """Append an error unless the same one is already recorded (reruns meet the same bad rows)."""
        key = _error_key(record)
        if key not in self._error_keys:
            self._error_keys.add(key)
            self._errors.append(record)

    def _rotate(self) -> None:
        self._writer.close()
        self._open_path.replace(self._shard_path(self._index))
        fsync_dir(self.root)
        self._index += 1
        self._open_path = self._shard_path(self._index, open_=True)
        self._writer = JsonlAppender(self._open_path)
        self._count = 0

    def close(self) -> None:
        """Flush everything. The open shard stays open: a later run appends to it."""
        self._writer.close()
        self._errors.close()

    def finalize(self) -> None:
        """Close the last shard for good (rename a non-empty open shard, drop an empty one)."""
        self.close()
        if self._count:
            self._open_path.replace(self._shard_path(self._index))
        else:
            self._open_path.unlink(missing_ok=True)
        fsync_dir(self.root)


def iter_samples(root: Path) -> Iterator[dict[str, Any]]:
    """Every complete sample of a generate folder (complete and open shards, torn tails ignored)."""
    for shard in sorted(Path(root).glob("samples-*.jsonl*")):
        with open(shard, "rb") as f:
            for line in f:
                if line.endswith(b"\n"):
                    try:
                        yield json.loads(line)
                    except json.JSONDecodeError:
                        return


def latest_errors(root: Path) -> dict[str, dict[str, Any]]:
    """The last error recorded per sample id (or per source row for rows without an id)."""
    path = Path(root) / "errors.jsonl"
    out: dict[str, dict[str, Any]] = {}
    if path.exists():
        for line in path.read_bytes().splitlines():
            try:
                e = json.loads(line)
            except json.JSONDecodeError:
                continue
            out[e.get("id") or f"row:{e.get('source')}"] = e
    return out
