"""Content-addressed stage artifacts: folders, markers, completeness and the latest pointer.

Every stage writes into ``<run dir>/<stage>/<key>/``; what a key hashes (the configuration the
stage's output depends on, its code version, its inputs' keys) is the stage's own declaration
in ``eagle3/stages.py``. ``<run dir>/<stage>/latest`` points at the folder the last run used,
which is what the CLI commands read by default ("train on the latest artifacts").

A folder is complete when its ``artifact.json`` (written last, atomically) names the expected
key and every file it lists is still there with the recorded size. Nothing here knows a
particular stage, and nothing imports Prefect: ``tasks/caching.py`` turns the keys into a
Prefect cache policy.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

from eagle3.atomic import replace_symlink, write_json_atomic
from eagle3.config import PipelineConfig

MARKER = "artifact.json"
LATEST = "latest"


def digest(obj: Any, n: int = 16) -> str:
    """Stable short hash of a JSON-able object (sorted keys, no whitespace)."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str, ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:n]


def file_digest(path: Path) -> str:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]
    except OSError:
        return "missing"


_target_ids: dict[tuple[str, str], str] = {}


def target_identity(cfg: PipelineConfig) -> dict[str, Any]:
    """What identifies the target's weights and tokenizer (not how it is served or named).

    An embedded target is named by its prepared folder, which carries the hash of the GGUF (or
    of the tiny model's recipe); other targets by their model id or path. ``served_model_name``
    is only a label on the API and is left out.
    """
    t = cfg.target.model_dump(mode="json", exclude={"served_model_name"})
    if cfg.target.is_embedded:
        memo = (cfg.target.model, str(cfg.paths.cache_dir))
        if memo not in _target_ids:
            from eagle3.embedded import planned_path

            _target_ids[memo] = planned_path(cfg.paths.cache_dir, cfg.target.embedded_name)[0].name
        t["model"] = f"{cfg.target.model}@{_target_ids[memo]}"
    return t


# ---------------------------------------------------------------------------
# Folders, manifests, the latest pointer


def listing(root: Path) -> dict[str, int]:
    """Relative path -> size of every file under ``root`` (hidden temporaries and the marker
    left out)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            if name.startswith(".") or name == MARKER:
                continue
            p = Path(dirpath) / name
            out[str(p.relative_to(root))] = p.stat().st_size
    return dict(sorted(out.items()))


def seal(
    out_dir: Path,
    stage: str,
    key: str,
    code_version: str,
    inputs: dict[str, str] | None = None,
    result: dict[str, Any] | None = None,
    config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Mark ``out_dir`` complete: write ``artifact.json`` (atomically, last) with the key, the
    inputs' keys, the stage's configuration, a small result summary and the size of every file."""
    out_dir = Path(out_dir)
    manifest = {
        "stage": stage,
        "key": key,
        "code_version": code_version,
        "inputs": dict(inputs or {}),
        "config": config,
        "result": result or {},
        "files": listing(out_dir),
        "sealed_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    write_json_atomic(out_dir / MARKER, manifest)
    return manifest


def read_marker(out_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((Path(out_dir) / MARKER).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def problems(out_dir: Path, key: str | None = None) -> list[str]:
    """Why ``out_dir`` is not a complete artifact (empty list: it is). Stats files only."""
    out_dir = Path(out_dir)
    m = read_marker(out_dir)
    if m is None:
        return [f"{out_dir}: no {MARKER} (never finished)"]
    if key is not None and m.get("key") != key:
        return [f"{out_dir}: {MARKER} names key {m.get('key')}, expected {key}"]
    out = []
    for rel, size in m.get("files", {}).items():
        p = out_dir / rel
        try:
            actual = p.stat().st_size
        except OSError:
            out.append(f"{p}: missing")
            continue
        if actual != size:
            out.append(f"{p}: {actual} bytes, {size} when sealed")
    if not m.get("files"):
        out.append(f"{out_dir}: sealed with no files")
    return out


def is_complete(out_dir: Path, key: str | None = None) -> bool:
    return not problems(out_dir, key)


def set_latest(cfg: PipelineConfig, stage: str, key: str) -> Path:
    """Point ``<run dir>/<stage>/latest`` at ``key`` (a relative symlink, swapped atomically)."""
    link = cfg.paths.stage_root(stage) / LATEST
    if link.is_symlink() and os.readlink(link) == key:
        return link
    return replace_symlink(link, key)


def latest(cfg: PipelineConfig, stage: str) -> tuple[Path, dict[str, Any]] | None:
    """(folder, manifest) of the stage's latest complete artifact, or None."""
    link = cfg.paths.stage_root(stage) / LATEST
    if not link.is_symlink():
        return None
    d = link.resolve()
    m = read_marker(d)
    if m is None or problems(d, m.get("key")):
        return None
    return d, m
