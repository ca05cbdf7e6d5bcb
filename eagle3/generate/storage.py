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
import logging
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3.atomic import fsync_dir

log = logging.getLogger(__name__)

OPEN_SUFFIX = ".open"
PERMANENT = {
    "rejected",
    "skipped",
}  # the prompt is the problem; "failed" (the server was) is retried on rerun
# Wrong URL / key, recorded as per-sample rejections before issue #16: a property of the setup,
# so retried.
_SETUP_STATUS = re.compile(r"rejected by server \((401|403|404)\)")


def is_permanent(e: dict[str, Any]) -> bool:
    """Whether an error record means the prompt itself is the problem (not resent on a rerun)."""
    return e.get("kind") in PERMANENT and not _SETUP_STATUS.match(str(e.get("reason", "")))


def _error_key(e: dict[str, Any]) -> tuple:
    return (e.get("id"), str(e.get("source")), e.get("kind"), e.get("reason"))


def repair_jsonl(
    path: Path, bad: list[tuple[str, str]] | None = None
) -> tuple[list[dict[str, Any]], int]:
    """Complete records of a jsonl file; a torn tail (kill mid-write) is truncated away.

    A complete line that does not parse (disk corruption, a hand edit) is skipped and reported in
    ``bad`` as ("file:line", reason), never truncated: cutting there would delete every later
    record. Returns (records, bytes dropped).
    """
    data = path.read_bytes()
    records: list[dict[str, Any]] = []
    good_end = 0
    pos = 0
    lineno = 0
    while pos < len(data):
        nl = data.find(b"\n", pos)
        if nl < 0:
            break  # no newline: the last write was cut
        lineno += 1
        try:
            records.append(json.loads(data[pos:nl]))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            if bad is not None:
                bad.append((f"{path}:{lineno}", f"unreadable line ({type(e).__name__}: {e})"))
        good_end = pos = nl + 1
    dropped = len(data) - good_end
    if dropped:
        with open(path, "r+b") as f:
            f.truncate(good_end)
            f.flush()
            os.fsync(f.fileno())
    return records, dropped


class JsonlAppender:
    """One JSON record per line, one write per record; fsync every ``sync_every``.

    Unbuffered: a record is in the file when ``append`` returns, and a write that fails (disk
    full) is cut back off, so no half record is left behind for a later append to follow."""

    def __init__(self, path: Path, sync_every: int = 64):
        self.path = path
        self.f = open(path, "ab", buffering=0)
        self.sync_every = sync_every
        self._since_sync = 0

    def append(self, record: dict[str, Any]) -> None:
        view = memoryview(
            json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n"
        )
        start = self.f.seek(0, os.SEEK_END)
        try:
            while view:
                view = view[self.f.write(view) :]
        except OSError:
            self.f.truncate(start)
            raise
        self._since_sync += 1
        if self._since_sync >= self.sync_every:
            self.sync()

    def sync(self) -> None:
        os.fsync(self.f.fileno())
        self._since_sync = 0

    def close(self) -> None:
        if not self.f.closed:
            self.sync()
            self.f.close()


def _sample_ids(records: list[Any], shard: Path, bad: list[tuple[str, str]]) -> list[str]:
    """Ids of the usable sample records; the others go to ``bad`` (their samples are redone)."""
    ids = []
    for r in records:
        why = not_a_sample(r)
        if why:
            bad.append((str(shard), f"unreadable line ({why})"))
        else:
            ids.append(r["id"])
    return ids


def _empty_ids(records: list[Any]) -> set[str]:
    """Ids of sample records with no completion token (stored before issue #39 made them errors)."""
    return {r["id"] for r in records if not not_a_sample(r) and not r["completion_token_ids"]}


class ShardStore:
    """Sample shards + errors file of one generate output folder."""

    def __init__(self, root: Path, shard_size: int = 1000):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.shard_size = shard_size
        self.torn_bytes = 0
        self.bad_lines: list[
            tuple[str, str]
        ] = []  # unreadable complete lines: skipped, their samples redone
        self.done_ids: set[str] = set()
        # what two writers at once (or an older version) left: found here, removed by repair()
        self.duplicates = 0
        self.empty: set[str] = set()
        complete = sorted(self.root.glob("samples-*.jsonl"))
        for shard in complete:
            records, dropped = repair_jsonl(shard, self.bad_lines)
            self.torn_bytes += dropped
            self._take(records, shard)
        open_shards = sorted(self.root.glob(f"samples-*.jsonl{OPEN_SUFFIX}"))
        if len(open_shards) > 1:
            raise RuntimeError(
                f"{self.root}: more than one open shard {open_shards}; "
                "the folder was edited by hand"
            )
        self.errors_path = self.root / "errors.jsonl"
        self._error_keys: set[tuple] = set()
        self.permanent_ids: set[str] = set()  # latest error says the prompt itself is the problem
        if self.errors_path.exists():
            errors, dropped = repair_jsonl(self.errors_path)
            self.torn_bytes += dropped
            for e in errors:
                self._error_keys.add(_error_key(e))
                if e.get("id"):
                    (self.permanent_ids.add if is_permanent(e) else self.permanent_ids.discard)(
                        e["id"]
                    )
        if open_shards:
            self._open_path = open_shards[0]
            records, dropped = repair_jsonl(self._open_path, self.bad_lines)
            self.torn_bytes += dropped
            self._take(records, self._open_path)
            self._count = len(records)
            self._index = int(self._open_path.name.split("-")[1].split(".")[0])
        else:
            self._index = len(complete)
            self._open_path = self._shard_path(self._index, open_=True)
            self._count = 0
        self._writer = JsonlAppender(self._open_path)
        self._errors = JsonlAppender(self.errors_path)

    def _take(self, records: list[Any], shard: Path) -> None:
        ids = _sample_ids(records, shard, self.bad_lines)
        self.duplicates += len(ids) - len(set(ids)) + len(self.done_ids.intersection(ids))
        self.empty |= _empty_ids(records)
        self.done_ids.update(ids)

    def repair(self) -> tuple[int, int]:
        """Drop duplicate records (the first of each id is kept) and records with no completion
        token; returns (duplicates dropped, empty records dropped). Their samples are requested
        again where none is left. Why: two writers in one folder left 250 records for 200 prompts
        and the folder stayed stuck (issue #39); an empty completion was stored as a sample and
        counted as done. A no-op (no rewrite) when the folder is clean."""
        if not self.duplicates and not self.empty:
            return 0, 0
        self._writer.close()
        seen: set[str] = set()
        dup = empty = 0
        for shard in sorted(self.root.glob("samples-*.jsonl*")):
            kept, n = [], 0
            with open(shard, "rb") as f:
                for raw in f:
                    record = _parse(raw) if raw.endswith(b"\n") else None
                    if record is not None and not not_a_sample(record):
                        if not record["completion_token_ids"]:
                            empty, n = empty + 1, n + 1
                            continue
                        if record["id"] in seen:
                            dup, n = dup + 1, n + 1
                            continue
                        seen.add(record["id"])
                    kept.append(raw)
            if n:
                _rewrite(shard, kept)
        fsync_dir(self.root)
        self.done_ids = seen
        self.duplicates, self.empty = 0, set()
        if self._open_path.exists():
            self._count = len(repair_jsonl(self._open_path)[0])
        self._writer = JsonlAppender(self._open_path)
        return dup, empty

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

    def drop(self, ids: set[str]) -> int:
        """Remove these samples from the shards; returns how many records went. Each shard that
        holds one is rewritten under a temporary name (not matched by ``samples-*``) and renamed
        over the old one, so a kill leaves either shard whole. Their ids are requested again.
        Why: a rerun found their token ids wrong (issue #30); keeping them trained the draft on
        ids that mean other tokens."""
        self._writer.close()
        dropped = 0
        for shard in sorted(self.root.glob("samples-*.jsonl*")):
            kept, n = [], 0
            with open(shard, "rb") as f:
                for raw in f:
                    if raw.endswith(b"\n") and _record_id(raw) in ids:
                        n += 1
                    else:
                        kept.append(raw)
            if n:
                _rewrite(shard, kept)
                dropped += n
        fsync_dir(self.root)
        self.done_ids -= ids
        if self._open_path.exists():
            self._count = sum(1 for _ in repair_jsonl(self._open_path)[0])
        self._writer = JsonlAppender(self._open_path)
        return dropped

    def add_error(self, record: dict[str, Any]) -> None:
        """Append an error unless the same one is already recorded (reruns meet the same bad
        rows)."""
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


def _rewrite(shard: Path, lines: list[bytes]) -> None:
    """Replace ``shard`` with ``lines`` under a temporary name (not matched by ``samples-*``), so
    a kill leaves either version whole."""
    tmp = shard.with_name(f".{shard.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(b"".join(lines))
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(shard)


def _parse(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None


def _record_id(raw: bytes) -> str | None:
    record = _parse(raw)
    return record.get("id") if isinstance(record, dict) else None


SAMPLE_LISTS = ("prompt_token_ids", "completion_token_ids")


def not_a_sample(record: Any) -> str | None:
    """Why a parsed line is not a usable sample record (None if it is). Why check here: a record
    without ``prompt_token_ids`` made extract die with a KeyError naming neither file nor line
    (issue #30); now every reader skips it as an unreadable line, named, and generate requests
    that sample again."""
    if not isinstance(record, dict) or "id" not in record:
        return "not a sample record (no id)"
    for key in SAMPLE_LISTS:
        ids = record.get(key)
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            return f"not a sample record ({key} missing or not a list of ids)"
    return None


def iter_samples(
    root: Path, on_bad: Callable[[str, str], None] | None = None
) -> Iterator[dict[str, Any]]:
    """Every complete sample of a generate folder (complete and open shards).

    A line that does not parse, or a shard's last line cut off without its newline, is skipped and
    reported to ``on_bad(\"file:line\", reason)`` (default: a logged warning); reading goes on with
    the next line and shard. Stopping there silently dropped every later sample (issue #16).
    """
    report = on_bad or (lambda where, reason: log.warning("%s: %s; skipped", where, reason))
    for shard in sorted(Path(root).glob("samples-*.jsonl*")):
        with open(shard, "rb") as f:
            for lineno, line in enumerate(f, 1):
                if not line.endswith(b"\n"):
                    if not shard.name.endswith(
                        OPEN_SUFFIX
                    ):  # an open shard's torn tail is a kill in progress
                        report(f"{shard}:{lineno}", "last line cut off (no newline)")
                    continue
                try:
                    record = json.loads(line)
                except (ValueError, UnicodeDecodeError) as e:
                    report(f"{shard}:{lineno}", f"unreadable line ({type(e).__name__}: {e})")
                    continue
                why = not_a_sample(record)
                if why:
                    report(f"{shard}:{lineno}", f"unreadable line ({why})")
                    continue
                yield record


@dataclass
class SampleScan:
    """What a generate folder holds, read once: sample ids and the lines that could not be read."""

    ids: set[str]
    bad: list[tuple[str, str]]


def scan_samples(root: Path) -> SampleScan:
    scan = SampleScan(set(), [])
    for r in iter_samples(root, on_bad=lambda where, reason: scan.bad.append((where, reason))):
        scan.ids.add(r["id"])
    return scan


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
