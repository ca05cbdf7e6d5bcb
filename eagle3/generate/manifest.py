"""The generate stage's manifest.json: this run's counts and rates, and what the folder holds.

- :func:`run_manifest`: the manifest one run writes (config, dataset, endpoints, tokenizer
  fingerprint, ``this_run``, ``totals``).
- :func:`folder_totals`: samples, tokens, flags and current errors of a generate folder.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle3.config import PipelineConfig
from eagle3.fingerprint import server_fingerprint
from eagle3.generate.checks import CHECKED_FIELD
from eagle3.generate.prompts import PromptStats
from eagle3.generate.storage import iter_samples, latest_errors

if TYPE_CHECKING:
    from eagle3.generate.runner import _GenerateRun


def run_manifest(
    cfg: PipelineConfig,
    base_urls: list[str],
    window: int,
    stats: PromptStats,
    runner: _GenerateRun,
    resumed_from: int,
    wall: float,
    out_dir: Path,
) -> dict[str, Any]:
    g, store, progress = cfg.generate, runner.store, runner.progress
    totals = folder_totals(out_dir)
    return {
        "stage": "generate",
        "target": cfg.target.model,
        "served_model_name": cfg.target.served_model_name,
        "config": g.model_dump(mode="json"),
        "dataset": {"name": g.dataset, "split": g.split, "fingerprint": stats.fingerprint},
        "endpoints": base_urls,
        "tokenizer_fingerprint": server_fingerprint(
            base_urls[0], cfg.target.served_model_name, g.chat_template_kwargs, cfg.serve.api_key
        ),
        "concurrency": window,
        "this_run": {
            "resumed_from": resumed_from,
            "counts": dict(runner.counts),
            "prompt_rows": asdict(stats),
            "torn_bytes_dropped": store.torn_bytes,
            "unreadable_lines": [f"{w}: {r}" for w, r in store.bad_lines],
            "token_ids_checked": runner.token_check.checked,
            "token_ids_rechecked": runner.token_check.rechecked,
            "wall_s": round(wall, 2),
            "completion_tokens": progress.completion_tokens,
            "prompt_tokens": runner.prompt_tokens,
            "completion_tokens_per_s": round(progress.completion_tokens / max(wall, 1e-9), 1),
            "requests_per_s": round(progress.done / max(wall, 1e-9), 2),
        },
        "totals": totals,
        "token_check": token_check_summary(runner.token_check, totals),
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def folder_totals(out_dir: Path) -> dict[str, Any]:
    n = prompt_tokens = completion_tokens = unmarked = 0
    flags: Counter[str] = Counter()
    done: set[str] = set()
    for r in iter_samples(out_dir):
        done.add(r["id"])
        n += 1
        prompt_tokens += len(r["prompt_token_ids"])
        completion_tokens += len(r["completion_token_ids"])
        flags.update(r.get("flags", []))
        unmarked += CHECKED_FIELD not in r
    # a failure that a later run filled in is history, not a current error
    errors = {k: e for k, e in latest_errors(out_dir).items() if e.get("id") not in done}
    return {
        "samples": n,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "flags": dict(flags),
        "errors_by_kind": dict(Counter(e["kind"] for e in errors.values())),
        "token_ids_not_marked_checked": unmarked,
    }


def token_check_summary(check: Any, totals: dict[str, Any]) -> dict[str, Any]:
    """How the folder's token ids were checked. ``unchecked_samples`` is what extract reads: 0
    when this run had the tokenizer (it checked every new sample and re-checked the stored
    ones), else the samples no run marked as checked; ``unchecked`` says why."""
    return {
        "tokenizer": check.source,
        "fingerprint": check.fingerprint,
        "unchecked": check.unchecked,
        "unchecked_samples": 0 if check.active else totals["token_ids_not_marked_checked"],
    }
