"""Prefect's side of the content-addressed artifacts in eagle3/artifacts.py.

Prefect's default cache key includes the flow run id, and its ``INPUTS`` policy would hash a
path string, not what the path holds. Here the key is the artifact's own content key: the
last part of the task's ``out_dir`` (``<run dir>/<stage>/<key>``), which eagle3.artifacts
computed from the stage's configuration, code version and input keys. Generate adds the hash
of the prompt selection, so new prompts in the dataset are a miss.

A Prefect record alone is not trusted: before each call the flow checks the folder
(``artifact.json`` present, every listed file there with its size) and sets
``refresh_cache`` when it is not complete, so a deleted or truncated artifact is recomputed
and the record overwritten. Records are small JSON documents (``result_serializer="json"``,
no pickle) kept beside the artifacts, in ``<run dir>/.prefect-results``, so they share the
artifacts' lifetime: delete a run folder and its cache goes with it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefect import Task
from prefect.cache_policies import CachePolicy
from prefect.context import TaskRunContext

from eagle3.config import PipelineConfig


@dataclass
class ArtifactKey(CachePolicy):
    """Cache key = ``<task name>-<artifact key>[-<extra inputs>]``; the artifact key is
    ``out_dir``'s name."""

    extra: tuple[str, ...] = field(default=())

    def compute_key(
        self,
        task_ctx: TaskRunContext,
        inputs: dict[str, Any],
        flow_parameters: dict[str, Any],
        **kwargs: Any,
    ) -> str | None:
        out_dir = inputs.get("out_dir")
        if not out_dir:
            return None  # not a stage call: no caching rather than a wrong hit
        parts = [
            task_ctx.task.name,
            Path(out_dir).name,
            *(str(inputs.get(name, "")) for name in self.extra),
        ]
        return "-".join(parts)


ARTIFACT_KEY = ArtifactKey()
GENERATE_KEY = ArtifactKey(extra=("selection",))

# Shared by every stage task: results are tiny JSON documents, persisted so that they can be cached.
CACHED = {"persist_result": True, "result_serializer": "json"}


@dataclass
class StageCall:
    """How one stage went in this flow run."""

    stage: str
    key: str
    out_dir: str
    status: str  # "ran", "cached", "latest" (not selected: the latest artifact was used), "failed"
    result: dict[str, Any] = field(default_factory=dict)
    task_wall_s: float = 0.0  # the task call as the flow saw it (Prefect's bookkeeping included)
    lib_wall_s: float = 0.0  # the library call inside the task (0 on a cache hit)
    state: str | None = None

    @property
    def cached(self) -> bool:
        return self.status == "cached"

    @property
    def overhead_s(self) -> float:
        return max(self.task_wall_s - self.lib_wall_s, 0.0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "key": self.key,
            "dir": self.out_dir,
            "state": self.state,
            "task_wall_s": round(self.task_wall_s, 3),
            "lib_wall_s": round(self.lib_wall_s, 3),
            "overhead_s": round(self.overhead_s, 3),
        }


def call_stage(
    task: Task, cfg: PipelineConfig, stage: str, out_dir: Path, refresh: bool, **kwargs: Any
) -> StageCall:
    """Run a stage task with the artifact cache: a hit returns the stored result without running.

    Raises what the task raised (after its retries). ``lib_wall_s`` comes from the result's
    ``lib_wall_s`` (our tasks time their library call) or ``wall_s`` (the verify report's).
    """
    t0 = time.monotonic()
    state = task.with_options(
        refresh_cache=refresh, result_storage=cfg.paths.results_dir.resolve(), **CACHED
    )(cfg=cfg, out_dir=str(out_dir), **kwargs, return_state=True)
    wall = time.monotonic() - t0
    result = state.result()  # raises the task's exception when it failed
    cached = state.name == "Cached"
    lib = 0.0 if cached else float(result.get("lib_wall_s") or result.get("wall_s") or 0.0)
    return StageCall(
        stage,
        Path(out_dir).name,
        str(out_dir),
        "cached" if cached else "ran",
        result,
        wall,
        lib,
        state.name,
    )
