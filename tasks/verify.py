"""Prefect task around `eagle3.verify.verify`: baseline vs speculative server, report, gate.

No retries: a failed gate is a result, not a transient error (the report is written first)."""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from eagle3.config import PipelineConfig


@task(name="verify", retries=0, cache_policy=NO_CACHE, persist_result=False)
def verify_task(cfg: PipelineConfig, model: str, draft_dir: str, out_dir: str) -> dict:
    """Serve target alone, then target + draft; measure; gate; promote. Returns the report dict
    (keys include ``acceptance_length``, ``speedup``, ``gate`` {passed, reasons}, ``promoted``).
    Raises ``eagle3.verify.GateFailed`` when the gate fails (the report is on disk by then)."""
    from eagle3.verify import verify

    logger = get_run_logger()
    report = verify(cfg, model, Path(draft_dir), Path(out_dir), log=logger.info)
    return report
