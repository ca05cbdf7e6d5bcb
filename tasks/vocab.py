"""Prefect task around the vocab stage (`eagle3.vocab.runner`, through eagle3.stages)."""

from __future__ import annotations

import time
from pathlib import Path

from prefect import task
from prefect.artifacts import create_table_artifact

from eagle3.config import PipelineConfig
from eagle3.stages import run_stage
from tasks.caching import ARTIFACT_KEY
from tasks.retries import TIMEOUT_S, transient_only


@task(
    name="vocab",
    cache_policy=ARTIFACT_KEY,
    retries=1,
    retry_delay_seconds=10,
    retry_condition_fn=transient_only,
    timeout_seconds=TIMEOUT_S["vocab"],
)
def vocab_task(cfg: PipelineConfig, out_dir: str, input_dirs: dict[str, str]) -> dict:
    t0 = time.monotonic()
    _, m, _ = run_stage(cfg, "vocab", input_dirs, Path(out_dir))
    lib_wall = time.monotonic() - t0
    create_table_artifact(
        key="vocab-coverage",
        table=m["coverage_curve"],
        description=f"Share of loss tokens covered by a draft vocab of each size "
        f"(chosen {m['draft_vocab_size']}: {m['coverage']:.2%})",
    )
    return {**m, "lib_wall_s": round(lib_wall, 3)}
