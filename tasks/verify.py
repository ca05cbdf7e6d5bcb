"""Prefect task around `eagle3.verify.verify`: baseline vs speculative server (and the n-gram
baseline server), report, gate.

No retries: a failed gate is a result, not a transient error (the report is written first)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task

from eagle3.config import PipelineConfig
from tasks.caching import ARTIFACT_KEY
from tasks.progress import ThrottledProgress
from tasks.retries import TIMEOUT_S


# Cached by the artifact key (out_dir's name: train key + verify settings + target + serve
# settings).
@task(name="verify", retries=0, cache_policy=ARTIFACT_KEY, timeout_seconds=TIMEOUT_S["verify"])
def verify_task(cfg: PipelineConfig, model: str, input_dirs: dict[str, str], out_dir: str) -> dict:
    """Serve target alone, then target + draft; measure; gate; promote. Returns the report dict
    (keys include ``acceptance_length``, ``speedup``, ``gate`` {passed, reasons}, ``promoted``).
    Raises ``eagle3.verify.GateFailed`` when the gate fails (the report is on disk by then)."""
    from eagle3.stages import run_stage
    from eagle3.verify import GateFailed

    logger = get_run_logger()
    v = cfg.verify
    per_method = min(len(v.ks), len(v.ks) if v.sweep_measure_all else v.sweep_servers)
    servers = 1 + (2 if v.ngram_baseline else 1) * per_method  # at most, for a k sweep
    windows = servers * len(v.concurrency)  # every server, every concurrency
    progress = _Progress(windows)
    try:
        _, report, _ = run_stage(
            cfg,
            "verify",
            input_dirs,
            Path(out_dir),
            model=model,
            on_progress=progress,
            log=logger.info,
        )
    except GateFailed:
        if (Path(out_dir) / "report.json").is_file():
            _publish(Path(out_dir))
        raise
    progress.bar.done()
    _publish(Path(out_dir))
    ng = report.get("ngram") or {}
    logger.info(
        "verify: acceptance length %s, speedup %s, gate passed, promoted %s; n-gram baseline %s",
        report["acceptance_length"],
        report["speedup"],
        report["promoted"],
        f"acceptance length {ng.get('acceptance_length')} (proposing steps), "
        f"{ng.get('acceptance_length_all_steps')} (all steps), speedup {ng.get('speedup')}"
        if ng.get("measured")
        else f"not measured ({ng.get('reason')})",
    )
    return report


class _Progress:
    """The ``verify-progress`` artifact: requests done over every server's windows."""

    def __init__(self, windows: int) -> None:
        self.windows = windows
        self.done: dict[tuple[str, int], int] = {}
        self.bar = ThrottledProgress("verify-progress", "verify: requests done")

    def __call__(self, label: str, c: int, done: int, requests: int) -> None:
        self.done[(label, c)] = done
        self.bar.update(100.0 * sum(self.done.values()) / (self.windows * requests))


def _publish(out: Path) -> None:
    """The report's Prefect artifacts: acceptance per position, throughput, the markdown."""
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    report = json.loads((out / "report.json").read_text())
    create_table_artifact(
        key="verify-acceptance",
        description="Acceptance per draft position (draft vs the n-gram baseline)",
        table=_acceptance_rows(report),
    )
    create_table_artifact(
        key="verify-throughput",
        description="Baseline vs speculative vs n-gram",
        table=_throughput_rows(report),
    )
    if report.get("serving"):
        create_table_artifact(
            key="verify-serving",
            description="What to serve: each method at its best measured k, per concurrency",
            table=_serving_rows(report),
        )
    create_markdown_artifact(
        key="verify-report",
        markdown=(out / "report.md").read_text() + f"\n\nPlot: `{out / 'report.png'}`\n",
    )


def _measured_ngram(report: dict[str, Any]) -> dict[str, Any]:
    return report.get("ngram") if (report.get("ngram") or {}).get("measured") else {}


def _acceptance_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    per_pos = report["acceptance"]["acceptance_per_position"]
    offline = (report.get("offline") or {}).get("acceptance_per_position") or []
    ng = _measured_ngram(report)
    ng_pos = ng.get("acceptance_per_position") or []
    ng_all = ng.get("acceptance_per_position_all_steps") or []
    at = lambda xs, i: round(xs[i], 4) if i < len(xs) else None  # noqa: E731
    return [
        {
            "position": i,
            "vLLM accepted / drafts": round(x, 4),
            "offline estimate": at(offline, i),
            "n-gram (vLLM, proposing steps)": at(ng_pos, i),
            "n-gram (all steps, simulated)": at(ng_all, i),
        }
        for i, x in enumerate(per_pos)
    ]


def _throughput_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    ng_windows = {w["concurrency"]: w for w in _measured_ngram(report).get("windows") or []}
    rows = []
    for w in report["windows"]:
        ng_w = ng_windows.get(w["concurrency"]) or {}
        rows.append(
            {
                "concurrency": w["concurrency"],
                "baseline tok/s": w["baseline"]["output_tokens_per_s"],
                "speculative tok/s": w["speculative"]["output_tokens_per_s"],
                "speedup": w["speedup"],
                "acceptance length": w["speculative"]["acceptance_length"],
                "greedy mismatches": (w["outputs"] or {}).get("mismatches"),
                "n-gram tok/s": ng_w.get("ngram", {}).get("output_tokens_per_s"),
                "n-gram speedup": ng_w.get("speedup"),
                "n-gram acceptance length": ng_w.get("ngram", {}).get("acceptance_length"),
            }
        )
    return rows


def _serving_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for c, e in report["serving"].items():
        ng = e.get("ngram") or {}
        rows.append(
            {
                "concurrency": int(c),
                "draft drafting": e.get("method", "sequential"),
                "draft k": e["num_speculative_tokens"],
                "draft tok/s": e["tokens_per_s"],
                "draft speedup": e["speedup"],
                "n-gram k": ng.get("num_speculative_tokens"),
                "n-gram tok/s": ng.get("tokens_per_s"),
                "n-gram speedup": ng.get("speedup"),
                "--speculative-config": json.dumps(e["speculative_config"]),
            }
        )
    return rows
