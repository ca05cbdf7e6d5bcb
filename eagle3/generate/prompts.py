"""Prompts from any dataset, as chat messages with a stable id.

Sources: a hub dataset (name + split, through `datasets`) or a local jsonl / json / parquet
file. Local jsonl is read line by line here rather than by `datasets`, so that one malformed
line or one line of invalid UTF-8 costs that line (recorded with its line number), not the file.

Row formats (``generate.data_format``, ``auto`` detects per row):
  sharegpt  {"conversations": [{"from": "human"|"gpt"|"system", "value": ...}, ...]}
  messages  {"messages": [{"role": "user"|"assistant"|"system", "content": ...}, ...]}
  prompt    {"prompt": "..."}  (column name configurable)

``turns: first`` sends the first user turn (with a leading system turn if any); ``history``
sends everything up to the last assistant turn, so the target writes that turn itself.
The sample id is a hash of the prompt messages: stable across runs, reorderings and shards,
which is what makes exact resume and de-duplication possible.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROLE_ALIASES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "model": "assistant",
                "bot": "assistant", "system": "system"}


@dataclass
class Prompt:
    id: str
    messages: list[dict[str, str]]
    source_index: int | str


@dataclass
class Skip:
    """A row that cannot become a prompt; recorded in the errors file with its reason."""

    source_index: int | str
    reason: str
    id: str | None = None


@dataclass
class PromptStats:
    rows: int = 0
    duplicates: int = 0
    excluded: int = 0
    skipped: int = 0
    reasons: dict[str, int] = field(default_factory=dict)
    fingerprint: str = ""  # of the dataset, set when iteration starts


class RowError(ValueError):
    pass


def sample_id(messages: list[dict[str, str]]) -> str:
    canon = json.dumps([[m["role"], m["content"]] for m in messages], ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canon.encode("utf-8")).hexdigest()[:24]


def _normalise(turns: list[Any], role_key: str, content_key: str) -> list[dict[str, str]]:
    out = []
    for i, t in enumerate(turns):
        if not isinstance(t, dict):
            raise RowError(f"turn {i} is not an object")
        role = ROLE_ALIASES.get(str(t.get(role_key, "")).lower())
        content = t.get(content_key)
        if role is None:
            raise RowError(f"turn {i} has unknown role {t.get(role_key)!r}")
        if not isinstance(content, str):
            raise RowError(f"turn {i} has no text content")
        out.append({"role": role, "content": content})
    return out


def row_messages(row: dict[str, Any], data_format: str = "auto", prompt_column: str = "prompt",
                 messages_column: str | None = None) -> list[dict[str, str]]:
    """The conversation of a row as OpenAI-style messages. Raises RowError."""
    if not isinstance(row, dict):
        raise RowError("row is not an object")
    fmt = data_format
    if fmt == "auto":
        if messages_column and messages_column in row:
            fmt = "messages"
        elif "conversations" in row:
            fmt = "sharegpt"
        elif "messages" in row:
            fmt = "messages"
        elif prompt_column in row:
            fmt = "prompt"
        else:
            raise RowError(f"no conversations/messages/{prompt_column} column (keys: {sorted(row)[:8]})")
    if fmt == "prompt":
        value = row.get(prompt_column)
        if not isinstance(value, str):
            raise RowError(f"column {prompt_column!r} is not text")
        return [{"role": "user", "content": value}]
    col = messages_column or ("conversations" if fmt == "sharegpt" else "messages")
    turns = row.get(col)
    if not isinstance(turns, list):
        raise RowError(f"column {col!r} is not a list of turns")
    # ShareGPT rows sometimes use role/content too: accept either key pair per row.
    first = turns[0] if turns and isinstance(turns[0], dict) else {}
    keys = ("from", "value") if "from" in first else ("role", "content")
    return _normalise(turns, *keys)


def select_turns(messages: list[dict[str, str]], turns: str = "first") -> list[dict[str, str]]:
    """The request to send: the first user turn, or the history up to the last assistant turn."""
    system = [m for m in messages[:1] if m["role"] == "system"]
    if turns == "first":
        users = [m for m in messages if m["role"] == "user"]
        if not users:
            raise RowError("no user turn")
        picked = system + [users[0]]
    elif turns == "history":
        # a conversation that ends with its answer loses that answer (the target writes it);
        # one that ends with a question is sent whole
        last_assistant = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
        ends_answered = last_assistant is not None and last_assistant == len(messages) - 1
        picked = messages[:last_assistant] if ends_answered else list(messages)
        while picked and picked[-1]["role"] != "user":
            picked.pop()
        if not picked:
            raise RowError("no user turn before the last assistant turn")
    else:
        raise ValueError(f"turns must be 'first' or 'history', got {turns!r}")
    for m in picked:
        if m["role"] == "user" and not m["content"].strip():
            raise RowError("empty prompt")
    return picked


def read_jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any] | None, str | None]]:
    """(line number, row or None, error or None) for each non-blank line."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield lineno, None, f"invalid UTF-8 at byte {e.start}"
                continue
            try:
                yield lineno, json.loads(text), None
            except json.JSONDecodeError as e:
                yield lineno, None, f"malformed JSON: {e.msg} at column {e.colno}"


def open_rows(dataset: str, split: str = "train") -> tuple[list[Any] | Any, str]:
    """(indexable rows, fingerprint). Local jsonl gives (line, row, error) tuples."""
    path = Path(dataset)
    if path.suffix == ".jsonl":
        if not path.is_file():
            raise FileNotFoundError(f"dataset file {path} not found")
        fingerprint = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
        return list(read_jsonl(path)), fingerprint
    import datasets

    if path.exists():
        kind = {".json": "json", ".parquet": "parquet"}.get(path.suffix)
        if kind is None:
            raise ValueError(f"unsupported dataset file type {path.suffix!r} (jsonl, json, parquet)")
        ds = datasets.load_dataset(kind, data_files=str(path), split="train")
    else:
        ds = datasets.load_dataset(dataset, split=split)
    return ds, ds._fingerprint


def exclusion_keys(files: list[Path]) -> set[str]:
    """Normalised first-user-turn texts of prompts never to train on (e.g. MT-bench's 80)."""
    keys = set()
    for f in files:
        for _, row, err in read_jsonl(Path(f)):
            if err or not isinstance(row, dict):
                continue
            if isinstance(row.get("turns"), list) and row["turns"]:  # MT-bench question.jsonl
                keys.add(_key(str(row["turns"][0])))
                continue
            try:
                msgs = row_messages(row)
                keys.add(_key(next(m["content"] for m in msgs if m["role"] == "user")))
            except (RowError, StopIteration):
                continue
    return keys


def _key(text: str) -> str:
    return " ".join(text.lower().split())


def iter_prompts(
    dataset: str,
    *,
    split: str = "train",
    data_format: str = "auto",
    prompt_column: str = "prompt",
    messages_column: str | None = None,
    turns: str = "first",
    num_samples: int | None = None,
    seed: int = 0,
    exclude: set[str] = frozenset(),
    stats: PromptStats | None = None,
) -> Iterator[Prompt | Skip]:
    """Prompts in a seeded random order, de-duplicated, at most ``num_samples`` of them.

    Lazy: rows are parsed as they are reached, so a million-row dataset costs one
    permutation of indices up front, not a million parsed conversations.
    """
    stats = stats if stats is not None else PromptStats()
    rows, stats.fingerprint = open_rows(dataset, split)
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    seen: set[str] = set()
    taken = 0
    for idx in order:
        if num_samples is not None and taken >= num_samples:
            return
        stats.rows += 1
        row = rows[idx]
        where: int | str = idx
        if isinstance(row, tuple):  # local jsonl: (line, row, error)
            where, row, err = row
            where = f"line {where}"
            if err:
                stats.skipped += 1
                yield Skip(where, err)
                continue
        try:
            msgs = select_turns(row_messages(row, data_format, prompt_column, messages_column), turns)
        except RowError as e:
            stats.skipped += 1
            stats.reasons[str(e)] = stats.reasons.get(str(e), 0) + 1
            yield Skip(where, str(e))
            continue
        sid = sample_id(msgs)
        if sid in seen:
            stats.duplicates += 1
            continue
        seen.add(sid)
        first_user = next(m["content"] for m in msgs if m["role"] == "user")
        if _key(first_user) in exclude:
            stats.excluded += 1
            continue
        taken += 1
        yield Prompt(sid, msgs, where)
