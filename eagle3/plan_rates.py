"""The figures eagle3/plan_states.py prices the state layouts with: the target's and the
trainer's tokens/s (measured by a previous run of the profile where its manifests say so, else the
profile's ``plan:`` estimates) and the node's free disk and host memory."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3.config import PipelineConfig

GIB = 1024**3
# The rule of train.state_cache_gib auto (eagle3/train/state_cache.py, cache_plan, which imports
# these): at most half the available host memory, and the disk's free space less 10% of it (at
# least 5 GiB).
HOST_SHARE = 0.5
DISK_MARGIN_SHARE, DISK_MARGIN_MIN = 0.1, 5 * GIB


def gib(n: float) -> str:
    return f"{n / GIB:,.1f} GiB"


def manifest(folder: Path) -> dict[str, Any] | None:
    try:
        return json.loads((Path(folder) / "manifest.json").read_text())
    except (OSError, ValueError):
        return None


@dataclass
class Figure:
    """One number the prices use and where it came from (measured, an estimate, unknown)."""

    value: float | None
    source: str


def target_rate(cfg: PipelineConfig) -> Figure:
    """r_t: an offline extract of this profile's backend in the run folder, else plan's estimate.
    A token-only (online) extract ran no target, so its rate says nothing of it."""
    folder = cfg.paths.stage_dir("extract")
    m = manifest(folder) or {}
    run = m.get("this_run") or {}
    if (
        m.get("states", "offline") == "offline"
        and m.get("backend") == cfg.extract.backend
        and run.get("stored")
        and run.get("tokens_per_s")
    ):
        return Figure(
            float(run["tokens_per_s"]),
            f"measured: {folder / 'manifest.json'} ({run['stored']} samples computed)",
        )
    if cfg.plan.target_tokens_per_s:
        return Figure(cfg.plan.target_tokens_per_s, "estimate: plan.target_tokens_per_s")
    return Figure(None, "unknown: no offline extract here; set plan.target_tokens_per_s")


def train_rate(cfg: PipelineConfig) -> Figure:
    """r_d: a complete offline train run in the run folder (its extract's tokens x epochs over
    its loop), else plan's estimate. An online run's loop mixes the target in; a resumed run's
    loop covers part of its epochs: neither is used."""
    folder = cfg.paths.stage_dir("train")
    m = manifest(folder) or {}
    ext = manifest(Path(m.get("extract_dir") or folder / "none")) or {}
    epochs = (m.get("train_config") or {}).get("epochs")
    if (
        m.get("complete")
        and m.get("resumed_from_step") is None
        and (m.get("states") or {}).get("mode", "offline") == "offline"
        and m.get("loop_s")
        and ext.get("tokens")
        and epochs
    ):
        rate = ext["tokens"] * epochs / m["loop_s"]
        return Figure(
            rate,
            f"measured: {folder / 'manifest.json'} ({ext['tokens']:,} tokens x {epochs} epochs "
            f"in {m['loop_s']:.0f} s)",
        )
    if cfg.plan.train_tokens_per_s:
        return Figure(cfg.plan.train_tokens_per_s, "estimate: plan.train_tokens_per_s")
    return Figure(None, "unknown: no offline train run here; set plan.train_tokens_per_s")


@dataclass
class Node:
    """What the node gives the run: free disk at the run folder and available host memory."""

    disk: float
    memory: float
    source: str

    @property
    def room(self) -> float:
        """The disk the run may fill: free space less the margin."""
        return max(0.0, self.disk - max(DISK_MARGIN_SHARE * self.disk, DISK_MARGIN_MIN))


def _here(cfg: PipelineConfig) -> tuple[float, float, Path]:
    """(free disk at paths.runs_dir, available host memory) on this machine."""
    where = Path(cfg.paths.runs_dir).resolve()
    while not where.exists() and where != where.parent:
        where = where.parent
    memory = 0.0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                memory = int(line.split()[1]) * 1024.0
    except OSError:
        pass
    return float(shutil.disk_usage(where).free), memory, where


def plan_node(cfg: PipelineConfig, measure: bool = False) -> Node:
    """The node the plan prices: plan.node_disk_gib / host_memory_gib where set (a plan made away
    from the node), else this machine's (always with ``measure``: preflight runs on the node)."""
    disk, memory, where = _here(cfg)
    p = cfg.plan
    parts = []
    if p.node_disk_gib and not measure:
        disk = p.node_disk_gib * GIB
        parts.append(f"disk {gib(disk)} (plan.node_disk_gib)")
    else:
        parts.append(f"disk {gib(disk)} (free at {where})")
    if p.host_memory_gib and not measure:
        memory = p.host_memory_gib * GIB
        parts.append(f"host memory {gib(memory)} (plan.host_memory_gib)")
    else:
        parts.append(f"host memory {gib(memory)} (available here)")
    return Node(disk, memory, ", ".join(parts))
