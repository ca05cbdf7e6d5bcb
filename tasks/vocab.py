"""Prefect task around `eagle3.vocab.vocab_stage`."""

from __future__ import annotations

import time
from pathlib import Path

from prefect import task
from prefect.artifacts import create_table_artifact

from eagle3.config import PipelineConfig
from eagle3.vocab import vocab_stage
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
def vocab_task(cfg: PipelineConfig, out_dir: str, extract_dir: str) -> dict:
    t0 = time.monotonic()
    m = vocab_stage(
        Path(extract_dir),
        Path(out_dir),
        cfg.target.vocab_size,
        cfg.vocab.draft_vocab_size,
        {"target": cfg.target.model},
    )
    lib_wall = time.monotonic() - t0
    create_table_artifact(
        key="vocab-coverage",
        table=m["coverage_curve"],
        description=f"Share of loss tokens covered by a draft vocab of each size "
        f"(chosen {m['draft_vocab_size']}: {m['coverage']:.2%})",
    )
    return {**m, "lib_wall_s": round(lib_wall, 3)}
