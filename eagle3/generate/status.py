"""Where a generate folder stands, read without a server: what is left to request, and the
content key (data key) of what is there, which every later stage's key takes.

The generate folder is keyed by configuration only (target, sampling, which prompts) and
accumulates answers across runs; the flow reads :func:`generate_status` before it starts any
server, so a fully cached run starts none.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from eagle3.artifacts import digest, is_complete
from eagle3.config import PipelineConfig
from eagle3.generate.storage import is_permanent, iter_samples, latest_errors


@dataclass
class GenerateStatus:
    """Where the generate folder stands against the configured prompt selection (no server
    needed)."""

    key: str  # the folder's key (configuration only)
    out_dir: str
    selected: int  # prompts the profile selects now
    selection: str  # hash of their ids: new or edited prompts change it
    done: int  # samples in the folder (all runs)
    pending: int  # selected prompts to request: never answered, or failed for a transient reason
    # selected prompts the server rejected for good (retried only with retry_rejected)
    rejected: int
    sealed: bool  # a run finished and its files are intact

    @property
    def up_to_date(self) -> bool:
        return self.sealed and self.pending == 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def sample_ids(out_dir: Path) -> list[str]:
    """Ids of the complete samples in a generate folder (read-only; torn tails ignored)."""
    return [r["id"] for r in iter_samples(out_dir)] if Path(out_dir).is_dir() else []


def selected_prompt_ids(cfg: PipelineConfig) -> list[str]:
    """The ids the generate stage would request for this profile (dataset read, nothing sent)."""
    from eagle3.generate.prompts import Prompt, PromptStats
    from eagle3.generate.runner import load_prompts

    return [p.id for p in load_prompts(cfg, PromptStats()) if isinstance(p, Prompt)]


def generate_status(cfg: PipelineConfig, key: str | None = None) -> GenerateStatus:
    """Decide, before any server is started, whether generate has anything to do."""
    if key is None:
        from eagle3.keys import stage_key

        key = stage_key(cfg, "generate")
    out_dir = cfg.paths.artifact_dir("generate", key)
    selected = selected_prompt_ids(cfg)
    done = set(sample_ids(out_dir))
    errors = latest_errors(out_dir) if out_dir.is_dir() else {}
    permanent = {i for i, e in errors.items() if is_permanent(e)}
    todo = [i for i in selected if i not in done]
    rejected = sum(1 for i in todo if i in permanent)
    pending = len(todo) - (0 if cfg.generate.retry_rejected else rejected)
    return GenerateStatus(
        key=key,
        out_dir=str(out_dir),
        selected=len(selected),
        selection=digest(sorted(selected)),
        done=len(done),
        pending=pending,
        rejected=rejected,
        sealed=is_complete(out_dir, key),
    )


def data_key(generate_dir: Path, generate_key: str) -> str:
    """Content key of a generate folder: what extract and every later stage depend on.

    A hash of the sample shards' bytes in shard order. Shards are append-only and a sample is
    never written twice, so a regeneration that adds nothing (every retry failed again, or
    nothing was new) leaves it unchanged, while new samples, or a folder regenerated from
    scratch with sampling (different answers under the same ids), change it. Errors are not
    data: a new line in errors.jsonl changes nothing downstream.
    """
    h = hashlib.sha256(generate_key.encode())
    for shard in sorted(Path(generate_dir).glob("samples-*.jsonl*")):
        h.update(shard.name.split(".")[0].encode())
        with open(shard, "rb") as f:
            while block := f.read(1 << 22):
                h.update(block)
    return h.hexdigest()[:16]
