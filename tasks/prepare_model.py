"""Prefect task around `eagle3.embedded.prepare_model` (a no-op for non-embedded targets)."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from eagle3.config import PipelineConfig
from eagle3.embedded import prepare_model, resolve_model
from tasks.retries import TIMEOUT_S


@task(
    name="prepare-model",
    retries=1,
    retry_delay_seconds=5,
    cache_policy=NO_CACHE,
    timeout_seconds=TIMEOUT_S["prepare-model"],
)
def prepare_model_task(cfg: PipelineConfig) -> str:
    """Resolve the target model argument, converting the embedded GGUF first if needed.

    The library caches the conversion by the GGUF's hash, so a rerun costs one sha256.
    """
    if cfg.target.is_embedded:
        prepare_model(cfg.paths.cache_dir, cfg.target.embedded_name)
    return resolve_model(cfg.target.model, cfg.paths.cache_dir)
