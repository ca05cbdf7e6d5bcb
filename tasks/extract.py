"""Prefect task around the extract stage (`eagle3.extract.runner.extract`, through
eagle3.stages; a retry resumes by sample id)."""

from __future__ import annotations

import time
from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.tasks import exponential_backoff

from eagle3.config import PipelineConfig
from eagle3.stages import run_stage
from tasks.caching import ARTIFACT_KEY
from tasks.progress import ThrottledProgress
from tasks.retries import TIMEOUT_S, transient_only


@task(
    name="extract",
    cache_policy=ARTIFACT_KEY,
    retries=1,
    retry_delay_seconds=exponential_backoff(30),
    retry_condition_fn=transient_only,
    timeout_seconds=TIMEOUT_S["extract"],
)
def extract_task(
    cfg: PipelineConfig, out_dir: str, input_dirs: dict[str, str], model_path: str
) -> dict:
    logger = get_run_logger()
    bar = ThrottledProgress("extract-progress", "extract: samples stored")

    def progress(done: int, total: int) -> None:
        if total:
            bar.update(100.0 * done / total)

    t0 = time.monotonic()
    _, m, _ = run_stage(
        cfg, "extract", input_dirs, Path(out_dir), model=model_path, on_progress=progress
    )
    lib_wall = time.monotonic() - t0
    bar.done()
    logger.info(
        "extract: %d samples, %d tokens, %.0f bytes/token",
        m["samples"],
        m["tokens"],
        m["bytes_per_token"],
    )
    create_table_artifact(
        key="extract-stats",
        table=[
            {"metric": k, "value": str(v)}
            for k, v in [
                ("samples", m["samples"]),
                ("tokens", m["tokens"]),
                ("aux layers", m["aux_layers"]),
                ("storage dtype", m["storage_dtype"]),
                ("bytes/token", m["bytes_per_token"]),
                ("tokens/s (this run)", m["this_run"]["tokens_per_s"]),
                ("skipped", m["this_run"]["skipped"]),
                ("reused from the previous extract", m["this_run"]["reused"]),
                ("non-finite", m["this_run"]["nonfinite"]),
                ("truncated", m["this_run"]["truncated"]),
            ]
        ],
        description="Hidden-state extraction",
    )
    return {**m, "lib_wall_s": round(lib_wall, 3)}
