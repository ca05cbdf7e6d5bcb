"""The hero run's report: ``hero-run.json``, the UI's summary artifacts, the CLI's closing lines.

Everything here reads the summary dict that ``flows.hero_run._stages`` builds; nothing runs a
stage. ``ngram_summary`` stays importable from ``flows.hero_run`` too."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

from prefect.artifacts import create_markdown_artifact, create_table_artifact

from eagle3 import stages as stage_registry
from eagle3.atomic import write_json_atomic
from eagle3.config import PipelineConfig
from eagle3.verify.report import fmt
from flows.verdict import gate_words, verdict_lines

# (stage, file in its folder, title): the plots inlined in the summary
PLOTS = (
    ("vocab", "coverage.png", "Vocabulary coverage"),
    ("train", "metrics.png", "Training metrics"),
    ("verify", "report.png", "Verify: acceptance and speedup"),
)


def png_markdown(path: Path, title: str) -> str:
    """A plot inline (data URI): the UI shows it without access to the run's disk."""
    if not path.is_file() or path.stat().st_size > 400_000:
        return ""
    data = base64.b64encode(path.read_bytes()).decode()
    return f"\n### {title}\n\n![{title}](data:image/png;base64,{data})\n"


def _verify_report(verify_dir: str | None) -> dict[str, Any]:
    """The verify stage's report.json ({} when there is none or it cannot be read)."""
    try:
        return json.loads((Path(verify_dir) / "report.json").read_text()) if verify_dir else {}
    except (OSError, ValueError):
        return {}


def ngram_summary(verify_dir: str | None) -> str | None:
    """The n-gram baseline next to the draft, from the verify report (a cached verify has it
    too)."""
    ng = _verify_report(verify_dir).get("ngram")
    if not ng:
        return None
    if not ng.get("measured"):
        return f"not measured ({ng.get('reason')})"
    r = lambda x: None if x is None else round(x, 4)  # noqa: E731
    speedup = {c: r(x) for c, x in (ng.get("speedup") or {}).items()}
    return (
        f"acceptance length {r(ng.get('acceptance_length_all_steps'))} over all steps "
        f"({r(ng.get('acceptance_length'))} in vLLM's count over the steps where it proposed), "
        f"speedup {speedup}"
    )


def train_size(train_dir: str | None, info: dict[str, Any]) -> dict[str, Any]:
    """Samples, steps and epochs of the draft, from the train manifest (the artifact summary
    where the manifest cannot be read)."""
    try:
        m = json.loads((Path(train_dir) / "manifest.json").read_text()) if train_dir else {}
    except (OSError, ValueError):
        m = {}
    epochs = (m.get("train_config") or {}).get("epochs", info.get("epochs"))
    return {
        "samples": m.get("samples", info.get("samples")),
        "steps": m.get("steps", info.get("steps")),
        "epochs": epochs,
    }


def verdict(summary: dict[str, Any]) -> list[str]:
    """The verdict lines (flows/verdict.py) of a run with a verify stage."""
    stages = summary["stages"]
    if "verify" not in stages:
        return []
    train = stages.get("train", {})
    size = train_size(train.get("dir"), train.get("info") or {})
    return verdict_lines(_verify_report(stages["verify"].get("dir")), size)


def serving_summary(verify_dir: str | None) -> str | None:
    """Which k to serve, per concurrency: the draft at its best k vs n-gram at its best k (the
    verify report's ``serving``; a k sweep chose them)."""
    serving = _verify_report(verify_dir).get("serving")
    if not serving:
        return None

    def one(c: str, e: dict[str, Any]) -> str:
        ng = e.get("ngram")
        text = (
            f"c={c}: draft k={e['num_speculative_tokens']} {fmt(e['tokens_per_s'], 1)} tok/s "
            f"(x{fmt(e['speedup'], 2)})"
        )
        if ng:
            text += (
                f" vs n-gram k={ng['num_speculative_tokens']} {fmt(ng['tokens_per_s'], 1)} tok/s "
                f"(x{fmt(ng['speedup'], 2)})"
            )
        return text

    return "; ".join(one(c, e) for c, e in serving.items())


def write_report(cfg: PipelineConfig, summary: dict[str, Any]) -> None:
    """hero-run.json in the run dir, and the UI's markdown summary and tables."""
    cfg.paths.run_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(cfg.paths.run_dir / "hero-run.json", summary)
    rows = _stage_rows(summary["stages"])
    create_table_artifact(
        key="hero-run-stages",
        table=rows,
        description="Stages of this hero run: cache hits, wall time, Prefect's overhead",
    )
    create_markdown_artifact(
        key="hero-run-summary",
        markdown="\n".join(_summary_lines(summary, rows)),
        description="Hero run summary",
    )


def _stage_rows(stages: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {
            "stage": s,
            "status": c["status"],
            "key": c["key"],
            "task s": c["task_wall_s"],
            "library s": c["lib_wall_s"],
            "Prefect overhead s": c["overhead_s"],
        }
        for s, c in stages.items()
    ]


def _summary_lines(summary: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    """The markdown summary: the run, one line per stage's result, the stage table, the plots."""
    stages = summary["stages"]
    server = summary["server"] or "none started (nothing to request)"
    lines = [
        f"# Hero run: {summary['profile']}",
        "",
        f"- target: `{summary['model']}`",
        f"- run dir: `{summary['run_dir']}`; wall time {summary['wall_s']:.1f} s",
        f"- server: {server}",
    ]
    if summary.get("smoke_chat"):
        lines.append(f"- smoke chat: {summary['smoke_chat']['content']!r}")
    lines += _stage_info_lines(summary)
    if summary.get("failed"):
        lines.append(f"- **failed in {summary['failed']['stage']}**: {summary['failed']['error']}")
    lines += ["", "| stage | status | key | task s | library s |", "|---|---|---|---|---|"]
    lines += [
        f"| {r['stage']} | {r['status']} | `{r['key']}` | {r['task s']} | {r['library s']} |"
        for r in rows
    ]
    for stage, name, title in PLOTS:
        if stage in stages:
            lines.append(png_markdown(Path(stages[stage]["dir"]) / name, title))
    return lines


def _stage_info_lines(summary: dict[str, Any]) -> list[str]:
    """One line per stage that ran or was reused, from its ``artifact.json`` result."""
    stages = summary["stages"]
    info = {s: c.get("info", {}) for s, c in stages.items()}
    lines = []
    if "generate" in info:
        g = info["generate"]
        lines.append(
            f"- generate: {g.get('samples')} samples, {g.get('completion_tokens')} completion "
            f"tokens, errors {g.get('errors_by_kind')}"
        )
    if "extract" in info:
        e = info["extract"]
        lines.append(
            f"- extract: {e.get('samples')} samples, {e.get('tokens')} tokens, "
            f"layers {e.get('aux_layers')}"
        )
    if "vocab" in info:
        v = info["vocab"]
        lines.append(
            f"- vocab: {v.get('draft_vocab_size')} draft ids cover {v.get('coverage', 0):.2%} "
            "of loss tokens"
        )
    if "train" in info:
        t = info["train"]
        lines.append(
            f"- train: {t.get('steps')} steps, final top-1 per TTT step {t.get('final_top1')}"
        )
    if summary.get("acceptance_length") is not None or "verify" in info:
        v = info.get("verify", {})
        lines.append(
            f"- **verify: acceptance length {summary.get('acceptance_length')}**, "
            f"speedup {v.get('speedup')}, gate {(v.get('gate') or {}).get('passed')}"
        )
        ngram = ngram_summary(stages.get("verify", {}).get("dir"))
        if ngram:
            lines.append(f"- n-gram baseline (prompt lookup, same workload): {ngram}")
        serving = serving_summary(stages.get("verify", {}).get("dir"))
        if serving:
            lines.append(f"- measured (each method at its best k): {serving}")
        lines += [f"- **{line}**" for line in verdict(summary)]
    return lines


def print_summary(summary: dict[str, Any]) -> None:
    """What ``python -m flows.hero_run`` prints once the run is done."""
    statuses = ", ".join(f"{s} {c['status']}" for s, c in summary["stages"].items())
    print(f"\nHero run {summary['profile']} finished in {summary['wall_s']} s ({statuses})")
    if summary["smoke_chat"]:
        print(
            f"server ready in {summary['server']['ready_s']} s; Q: What is the capital of France? "
            f"A: {summary['smoke_chat']['content']}"
        )
    info = {s: c["info"] for s, c in summary["stages"].items()}
    g, e, v, t = (info.get(s, {}) for s in ("generate", "extract", "vocab", "train"))
    print(
        f"generate: {g.get('samples')} samples; extract: {e.get('samples')} samples, "
        f"{e.get('tokens')} tokens; "
        f"vocab: {v.get('draft_vocab_size')} ids cover {v.get('coverage', 0):.2%}"
    )
    top1 = [round(x, 3) for x in (t.get("final_top1") or []) if x is not None]
    draft = stage_registry.STAGES["train"].file(summary["stages"]["train"]["dir"], "draft")
    print(
        f"train: {t.get('steps')} steps, final top-1 per TTT step {top1}; draft for vLLM at {draft}"
    )
    if "verify" in info:
        vf = info["verify"]
        per_pos = [round(x, 3) for x in (vf.get("acceptance_per_position") or [])]
        print(f"verify: speedup {vf.get('speedup')}, acceptance per position {per_pos}")
        print(gate_words(vf.get("gate") or {}, vf.get("promoted"), vf.get("acceptance_length")))
        serving = serving_summary(summary["stages"]["verify"].get("dir"))
        if serving:
            print(f"measured (each at its best k): {serving}")
        ngram = ngram_summary(summary["stages"]["verify"].get("dir"))
        print(
            f"acceptance length: {summary['acceptance_length']}"
            + (f" (n-gram baseline: {ngram})" if ngram else "")
        )
        for line in verdict(summary):  # the last lines, as the README says
            print(line)
