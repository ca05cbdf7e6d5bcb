"""Prefect task around `eagle3.extract.runner.extract` (a retry resumes by sample id)."""

from __future__ import annotations

import time
from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_progress_artifact, create_table_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE

from eagle3.config import PipelineConfig
from eagle3.extract.runner import extract


@task(name="extract", retries=1, retry_delay_seconds=10, cache_policy=NO_CACHE, persist_result=False)
def extract_task(cfg: PipelineConfig, generate_dir: str, out_dir: str, model_path: str) -> dict:
    logger = get_run_logger()
    artifact = create_progress_artifact(0.0, key="extract-progress", description="extract: samples stored")
    last = [0.0]

    def progress(done: int, total: int) -> None:
        if total and time.monotonic() - last[0] > 5:
            last[0] = time.monotonic()
            update_progress_artifact(artifact, min(100.0, 100.0 * done / total))

    m = extract(cfg, Path(generate_dir), Path(out_dir), model_path, on_progress=progress)
    update_progress_artifact(artifact, 100.0)
    logger.info("extract: %d samples, %d tokens, %.0f bytes/token", m["samples"], m["tokens"], m["bytes_per_token"])
    create_table_artifact(
        key="extract-stats",
        table=[{"metric": k, "value": str(v)} for k, v in [
            ("samples", m["samples"]), ("tokens", m["tokens"]), ("aux layers", m["aux_layers"]),
            ("storage dtype", m["storage_dtype"]), ("bytes/token", m["bytes_per_token"]),
            ("tokens/s (this run)", m["this_run"]["tokens_per_s"]), ("skipped", m["this_run"]["skipped"]),
            ("non-finite", m["this_run"]["nonfinite"]), ("truncated", m["this_run"]["truncated"])]],
        description="Hidden-state extraction",
    )
    return m
