"""Prefect task around the train stage (through eagle3.stages, which decides between one process
and torchrun). A retry resumes from the last checkpoint."""

from __future__ import annotations

import json
import time
from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.tasks import exponential_backoff

from eagle3.config import PipelineConfig
from eagle3.stages import STAGES, run_stage
from tasks.caching import ARTIFACT_KEY
from tasks.progress import ThrottledProgress
from tasks.retries import TIMEOUT_S, transient_only


@task(
    name="train",
    cache_policy=ARTIFACT_KEY,
    retries=1,
    retry_delay_seconds=exponential_backoff(30),
    retry_condition_fn=transient_only,
    timeout_seconds=TIMEOUT_S["train"],
)
def train_task(
    cfg: PipelineConfig, out_dir: str, input_dirs: dict[str, str], target_dir: str
) -> dict:
    logger = get_run_logger()
    bar = ThrottledProgress("train-progress", "train: optimizer steps", every_s=10.0)

    def progress(p: dict) -> None:
        last = p["step"] == p["total_steps"]
        if bar.update(100.0 * p["step"] / max(p["total_steps"], 1), force=last):
            logger.info("train: step %d/%d loss %s", p["step"], p["total_steps"], p["loss"])

    t0 = time.monotonic()
    _, m, _ = run_stage(
        cfg,
        "train",
        input_dirs,
        Path(out_dir),
        model=target_dir,
        on_progress=progress,
        log=logger.info,
    )
    lib_wall = time.monotonic() - t0
    history = json.loads(STAGES["train"].file(out_dir, "metrics").read_text())["epochs"]
    rows = [
        {
            "epoch": e["epoch"],
            "loss per step": str([round(x, 4) for x in e["loss"] if x is not None]),
            "top-1 per step": str([round(x, 3) for x in e["top1"] if x is not None]),
        }
        for e in history
    ]
    if rows:
        create_table_artifact(
            key="train-metrics", table=rows, description="Training metrics per epoch"
        )
    final = m.get("final") or {}
    create_markdown_artifact(
        key="train-summary",
        markdown=(
            f"# Draft trained\n\n- steps: {m['steps']} ({m['skipped_nan']} skipped for NaN)\n"
            f"- final top-1 per TTT step: {final.get('top1')}\n- export: `{m['export']}`\n"
            f"- plot: `{Path(out_dir) / 'metrics.png'}`\n"
        ),
    )
    return {**m, "lib_wall_s": round(lib_wall, 3)}
