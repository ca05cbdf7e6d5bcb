"""Prefect task around `eagle3.vocab.vocab_stage`."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE

from eagle3.config import PipelineConfig
from eagle3.vocab import vocab_stage


@task(name="vocab", retries=1, cache_policy=NO_CACHE, persist_result=False)
def vocab_task(cfg: PipelineConfig, extract_dir: str, out_dir: str) -> dict:
    m = vocab_stage(Path(extract_dir), Path(out_dir), cfg.target.vocab_size, cfg.vocab.draft_vocab_size,
                    {"target": cfg.target.model})
    create_table_artifact(key="vocab-coverage", table=m["coverage_curve"],
                          description=f"Share of loss tokens covered by a draft vocab of each size "
                                      f"(chosen {m['draft_vocab_size']}: {m['coverage']:.2%})")
    return m
