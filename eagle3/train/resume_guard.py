"""A training checkpoint belongs to the extract it was trained on (issue #30).

Why: a rerun into the same output after fixing NaN data resumed the diverged checkpoint (nothing
tied it to its data), ran no step, and failed again pointing at the clean folder. The identity is
cheap (no hidden state is read): ``index.json`` (ids, shards, lengths) and every shard's name,
size and modification time, so a re-extraction (a new folder, or shards rewritten) differs while
a copy that keeps times, or an extract rerun that added nothing, does not.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

log = logging.getLogger(__name__)


def extract_identity(extract_dir: Path) -> str:
    """What a checkpoint records of its extract (``state.json``'s ``extract``)."""
    root = Path(extract_dir)
    h = hashlib.sha256((root / "index.json").read_bytes())
    for shard in sorted(root.glob("*.safetensors")):
        st = shard.stat()
        h.update(f"{shard.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def resumable(ckpt: Path, identity: str, extract_dir: Path) -> bool:
    """Whether ``ckpt`` holds a checkpoint trained on this extract. One from before this check
    records none and resumes as before. One of another extract is not resumed, with a warning:
    the run starts over and the checkpoint is replaced at its first save."""
    if not (Path(ckpt) / "state.json").is_file():
        return False
    theirs = json.loads((Path(ckpt) / "state.json").read_text()).get("extract")
    if theirs is None or theirs == identity:
        return True
    log.warning(
        "%s: the checkpoint was trained on another extract than %s (identity %s, now %s): "
        "not resumed, training starts over",
        ckpt,
        extract_dir,
        theirs,
        identity,
    )
    return False
