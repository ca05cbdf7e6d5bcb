"""Prefect task around the generate stage (`eagle3.generate.runner.generate`, through
eagle3.stages).

A retry is a resume: samples already in the shards are skipped, so only what failed or was
never sent is requested again. The flow decides before starting any server whether there is
anything to request (``eagle3.generate.status.generate_status``); called without endpoints, the
stage only reports what the folder holds. Progress is a Prefect progress artifact; the
generation statistics are a table artifact.
"""

from __future__ import annotations

import time
from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import (
    create_table_artifact,
)
from prefect.tasks import exponential_backoff

from eagle3.config import PipelineConfig
from eagle3.generate.runner import Progress
from eagle3.stages import run_stage
from tasks.caching import GENERATE_KEY
from tasks.progress import ThrottledProgress
from tasks.retries import TIMEOUT_S, transient_only


def _summary(manifest: dict, lib_wall_s: float, requested: bool) -> dict:
    """The small JSON result Prefect keeps (the full manifest stays in the folder)."""
    run = manifest.get("this_run", {})
    return {
        "totals": manifest["totals"],
        "requested": requested,
        "this_run": {
            k: run.get(k)
            for k in (
                "resumed_from",
                "counts",
                "wall_s",
                "completion_tokens",
                "completion_tokens_per_s",
                "requests_per_s",
            )
        }
        if requested
        else None,
        "concurrency": manifest.get("concurrency"),
        "dataset": manifest.get("dataset"),
        "tokenizer_fingerprint": manifest.get("tokenizer_fingerprint"),
        "lib_wall_s": round(lib_wall_s, 3),
    }


@task(
    name="generate",
    cache_policy=GENERATE_KEY,
    retries=2,
    retry_delay_seconds=exponential_backoff(30),
    retry_jitter_factor=0.5,
    retry_condition_fn=transient_only,
    timeout_seconds=TIMEOUT_S["generate"],
)
def generate_task(
    cfg: PipelineConfig,
    out_dir: str,
    selection: str,
    base_urls: list[str],
    tokenizer_path: str | None = None,
) -> dict:
    """Request every selected prompt not yet answered (``selection`` only keys the cache)."""
    logger = get_run_logger()
    requested = bool(base_urls)
    bar = ThrottledProgress("generate-progress", "generate: samples done") if requested else None

    def report_progress(p: Progress) -> None:
        if p.total and bar and bar.update(100.0 * (p.done + p.failed + p.skipped) / p.total):
            logger.info(
                "generate: %d done, %d errors, %.0f tok/s",
                p.done,
                p.failed + p.skipped,
                p.tokens_per_s,
            )

    t0 = time.monotonic()
    options = {"base_urls": base_urls, "tokenizer_path": tokenizer_path}
    _, manifest, _ = run_stage(
        cfg,
        "generate",
        {},
        Path(out_dir),
        on_progress=report_progress,
        log=logger.info,
        options=options,
    )
    lib_wall = time.monotonic() - t0
    if not requested:
        return _summary(manifest, 0.0, requested=False)
    bar.done()
    _stats_table(manifest)
    return _summary(manifest, lib_wall, requested=True)


def _stats_table(manifest: dict) -> None:
    run, totals = manifest["this_run"], manifest["totals"]
    create_table_artifact(
        key="generate-stats",
        table=[
            {"metric": "samples in folder", "value": totals["samples"]},
            {"metric": "generated this run", "value": run["counts"].get("generated", 0)},
            {"metric": "resumed from", "value": run["resumed_from"]},
            {"metric": "errors by kind", "value": str(totals["errors_by_kind"])},
            {"metric": "flags", "value": str(totals["flags"])},
            {"metric": "completion tokens", "value": totals["completion_tokens"]},
            {"metric": "output tok/s (this run)", "value": run["completion_tokens_per_s"]},
            {"metric": "concurrency", "value": manifest["concurrency"]},
        ],
        description="Generation statistics",
    )
