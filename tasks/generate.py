"""Prefect task around `eagle3.generate.runner.generate`.

A retry is a resume: samples already in the shards are skipped, so only what failed or was
never sent is requested again. Progress is a Prefect progress artifact; the generation
statistics are a table artifact.
"""

from __future__ import annotations

import time
from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_progress_artifact, create_table_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE

from eagle3.config import PipelineConfig
from eagle3.generate.profile import profile_concurrency
from eagle3.generate.runner import Progress, generate


@task(name="generate", retries=2, retry_delay_seconds=30, cache_policy=NO_CACHE, persist_result=False)
def generate_task(cfg: PipelineConfig, base_urls: list[str], out_dir: str, tokenizer_path: str | None = None) -> dict:
    logger = get_run_logger()
    concurrency = cfg.generate.concurrency
    if concurrency == "auto":
        report = profile_concurrency(cfg, base_urls, Path(out_dir) / "profile")
        concurrency = report["knee"]
        logger.info("concurrency auto -> %d (best %d at %.0f tok/s)", concurrency, report["best"],
                    report["best_tokens_per_s"])
    artifact = create_progress_artifact(0.0, key="generate-progress", description="generate: samples done")
    last = [0.0]

    def report_progress(p: Progress) -> None:
        if p.total and time.monotonic() - last[0] > 5:
            last[0] = time.monotonic()
            update_progress_artifact(artifact, min(100.0, 100.0 * (p.done + p.failed + p.skipped) / p.total))
            logger.info("generate: %d done, %d errors, %.0f tok/s", p.done, p.failed + p.skipped, p.tokens_per_s)

    manifest = generate(cfg, base_urls, Path(out_dir), concurrency=concurrency, tokenizer_path=tokenizer_path,
                        on_progress=report_progress)
    update_progress_artifact(artifact, 100.0)
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
    return manifest
