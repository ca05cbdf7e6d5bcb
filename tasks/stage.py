"""The Prefect task of a stage that has no task module of its own: any entry of
``eagle3.stages.STAGES`` runs through it (the hero run names it after the stage), so a new stage
is in the flow as soon as it is in the registry. Its summary (what ``artifact.json`` keeps)
becomes a table artifact; a stage that wants richer artifacts gets a module like tasks/train.py."""

from __future__ import annotations

import time
from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact

from eagle3.config import PipelineConfig
from eagle3.stages import run_stage
from tasks.caching import ARTIFACT_KEY
from tasks.retries import TIMEOUT_S, transient_only


@task(
    name="stage",
    cache_policy=ARTIFACT_KEY,
    retries=1,
    retry_delay_seconds=30,
    retry_condition_fn=transient_only,
    timeout_seconds=TIMEOUT_S["stage"],
)
def stage_task(
    cfg: PipelineConfig,
    out_dir: str,
    input_dirs: dict[str, str],
    stage_name: str,
    model: str | None = None,
) -> dict:
    logger = get_run_logger()
    t0 = time.monotonic()
    _, _, summary = run_stage(
        cfg, stage_name, input_dirs, Path(out_dir), model=model, log=logger.info
    )
    lib_wall = time.monotonic() - t0
    logger.info("%s: %s", stage_name, summary)
    create_table_artifact(
        key=f"{stage_name}-summary",
        table=[{"field": k, "value": str(v)} for k, v in summary.items()],
        description=f"{stage_name}: the summary kept in artifact.json",
    )
    return {**summary, "lib_wall_s": round(lib_wall, 3)}
