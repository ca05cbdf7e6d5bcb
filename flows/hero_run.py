"""The hero run: every stage of the pipeline as one Prefect flow, with content-addressed caching.

    python -m flows.hero_run --config configs/smollm2-cpu.yaml [--set section.field=value ...]
                             [--stages train,verify] [--force train]

Works without a Prefect server (Prefect starts a temporary one); `make ui` runs it from the UI.
prepare-model -> [serve -> smoke chat, only if generate has prompts to request] -> generate ->
(server stopped) -> extract -> vocab -> train -> verify.

Each stage writes ``<run dir>/<stage>/<key>/`` (eagle3/stages.py says what each key hashes);
a stage whose folder is complete is a cache hit and does not run, so rerunning after a failure
redoes only the failed stage and what depends on it, and an unchanged rerun starts no server
at all. ``stages`` runs a subset (the others are read from their ``latest`` artifacts: "train
on the latest artifacts"); ``force`` recomputes stages, and everything after them, from scratch.
The report (hero-run.json, the UI's summary artifacts, the closing lines) is flows/hero_report.py.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from prefect import flow, get_run_logger
from pydantic import BaseModel, ConfigDict, Field

from eagle3 import PROJECT_ROOT, stages
from eagle3.config import ConfigError, PipelineConfig, load_config
from eagle3.generate.status import generate_status
from eagle3.input_checks import check_target_available
from eagle3.serving.gpus import units_restored
from flows.hero_report import ngram_summary as ngram_summary  # re-exported
from flows.hero_report import print_summary, write_report
from flows.stage_folders import one_run_per_profile, prepare_folder, run_stage_task, use_latest
from tasks.caching import StageCall
from tasks.extract import extract_task
from tasks.generate import generate_task
from tasks.prepare_model import prepare_model_task
from tasks.serve import LazyServer, stop_recorded_servers
from tasks.stage import stage_task
from tasks.train import train_task
from tasks.verify import verify_task
from tasks.vocab import vocab_task

Stage = Literal[stages.NAMES]  # the registry's stages: the UI form lists them
ALL_STAGES: list[Stage] = list(stages.NAMES)
DEFAULT_PROFILE = "configs/smollm2-cpu.yaml"


class HeroRunParams(BaseModel):
    """What a hero run does; Prefect renders this as the run form in the UI."""

    model_config = ConfigDict(extra="forbid")

    profile: str = Field(
        DEFAULT_PROFILE,
        description="Profile YAML (relative to the project, e.g. "
        "configs/smollm2-cpu.yaml) or a profile name (smollm2-cpu).",
    )
    overrides: list[str] = Field(
        default_factory=list,
        description="section.field=value, value read as YAML: "
        "train.epochs=3, extract.aux_layers=[2,15,27].",
    )
    stages: list[Stage] = Field(
        default_factory=lambda: list(ALL_STAGES),
        description="Stages to run. A stage "
        "left out is read from its latest artifact (e.g. ['train']: train on the latest "
        "extract and vocab).",
    )
    force: list[Stage] = Field(
        default_factory=list,
        description="Recompute these stages and everything after "
        "them from scratch, even when cached.",
    )


DEFAULT_PARAMS = HeroRunParams()


def resolve_profile(profile: str) -> Path:
    """A path as given, relative to the project, or a profile name under configs/."""
    p = Path(profile)
    for cand in (p, PROJECT_ROOT / p, PROJECT_ROOT / "configs" / f"{profile}.yaml"):
        if cand.is_file():
            return cand
    raise ConfigError(
        f"profile {profile!r} not found "
        f"(as a path, under {PROJECT_ROOT}, or as configs/<name>.yaml)"
    )


def load_params(params: HeroRunParams) -> PipelineConfig:
    return load_config(resolve_profile(params.profile), params.overrides)


def _stop_servers_hook(flow: Any, flow_run: Any, state: Any) -> None:
    """Failure, crash and cancellation hook: stop servers this run started that are still up.

    The flow's ``finally`` normally did it already; this covers a flow process that died
    without unwinding (the hook then runs in the runner's process)."""
    try:
        cfg = load_params(
            HeroRunParams.model_validate((flow_run.parameters or {}).get("params") or {})
        )
    except Exception:  # noqa: BLE001 - a hook must not mask the run's own error
        return
    for what in stop_recorded_servers(cfg, flow_run_id=str(flow_run.id)):
        print(f"hero-run {flow_run.name}: stopped {what} left by the run ({state.name})")


# ---------------------------------------------------------------------------
# One stage


def _generate(
    cfg: PipelineConfig, model: str, server: LazyServer, forced: set[str]
) -> tuple[StageCall, dict]:
    """Generate, deciding before any server starts whether there is anything to request."""
    logger = get_run_logger()
    key = stages.stage_key(cfg, "generate")
    out_dir = cfg.paths.artifact_dir("generate", key)
    refresh = prepare_folder("generate", out_dir, key, forced)
    status = generate_status(cfg, key)
    needs_server = status.pending > 0 or not (out_dir / "manifest.json").is_file()
    logger.info(
        "generate: %d prompts selected, %d in the folder, %d to request, %d rejected for good%s",
        status.selected,
        status.done,
        status.pending,
        status.rejected,
        "" if needs_server else ": no server needed",
    )
    urls = server.base_urls() if needs_server else []
    tokenizer = model if cfg.target.is_embedded else cfg.target.tokenizer
    call = run_stage_task(
        "generate",
        generate_task,
        cfg,
        key,
        forced,
        refresh=refresh or not status.up_to_date,
        selection=status.selection,
        base_urls=urls,
        tokenizer_path=tokenizer,
    )
    return call, status.to_dict()


# ---------------------------------------------------------------------------
# The flow


@flow(
    name="hero-run",
    log_prints=True,
    on_failure=[_stop_servers_hook],
    on_crashed=[_stop_servers_hook],
    on_cancellation=[_stop_servers_hook],
)
def hero_run(params: HeroRunParams = DEFAULT_PARAMS) -> dict[str, Any]:
    """Run the selected stages of a profile; cached stages are reused, not recomputed."""
    started = time.monotonic()
    cfg = load_params(params)
    check_target_available(
        cfg, for_server=True
    )  # a hub id with no network: at once, not after 50 s (#39)
    logger = get_run_logger()
    # one run per profile: a second one (the nightly, a click in the UI) waits, saying for whom;
    # systemd + serve.stop_running_unit: a unit that ran before the run runs after it
    # (eagle3.serving.gpus)
    with one_run_per_profile(cfg, log=logger.warning), units_restored(cfg, log=logger.info):
        return _stages(cfg, params, started)


@dataclass
class _HeroRun:
    """One hero run's stages so far: their calls, and the stage in progress (for the report)."""

    cfg: PipelineConfig
    selected: set[str]
    forced: set[str]
    model: str
    calls: dict[str, StageCall] = field(default_factory=dict)
    current: str = "generate"

    def stage(self, name: str, task: Any, **kwargs: Any) -> StageCall:
        """One stage on its inputs' folders (the stage reads what it needs from them)."""
        self.current = name
        if name not in self.selected:
            return use_latest(self.cfg, name)
        dirs = {i: self.calls[i].out_dir for i in stages.STAGES[name].inputs}
        keys = stages.input_keys(name, {i: Path(d) for i, d in dirs.items()})
        key = stages.stage_key(self.cfg, name, keys)
        return run_stage_task(name, task, self.cfg, key, self.forced, input_dirs=dirs, **kwargs)


def _stages(cfg: PipelineConfig, params: HeroRunParams, started: float) -> dict[str, Any]:
    selected = set(params.stages)
    forced = stages.dependants(params.force) & selected
    logger = get_run_logger()
    logger.info(
        "hero run of profile %s (run dir %s): stages %s, forced %s",
        cfg.name,
        cfg.paths.run_dir,
        [s for s in ALL_STAGES if s in selected],
        sorted(forced),
    )
    model = prepare_model_task(cfg)
    server = LazyServer(cfg, model)
    run = _HeroRun(cfg, selected, forced, model)
    summary = _new_summary(cfg, params, model)
    try:
        _generate_phase(run, server, summary)
        _later_stages(run, summary)
    except BaseException as e:
        _record_failure(run, summary, e)
        raise
    finally:
        _finish_summary(run, summary, started)
    logger.info(
        "hero run done in %.1f s: %s",
        summary["wall_s"],
        ", ".join(f"{s} {c['status']}" for s, c in summary["stages"].items()),
    )
    return summary


def _new_summary(cfg: PipelineConfig, params: HeroRunParams, model: str) -> dict[str, Any]:
    return {
        "profile": cfg.name,
        "run_dir": str(cfg.paths.run_dir),
        "model": model,
        "params": params.model_dump(mode="json"),
        "stages": {},
        "server": None,
        "smoke_chat": None,
        "generate_status": None,
        "acceptance_length": None,
        "failed": None,
    }


def _generate_phase(run: _HeroRun, server: LazyServer, summary: dict[str, Any]) -> None:
    """Generate (or its latest artifact), then stop the server whatever happened."""
    try:
        if "generate" in run.selected:
            run.calls["generate"], summary["generate_status"] = _generate(
                run.cfg, run.model, server, run.forced
            )
        else:
            run.calls["generate"] = use_latest(run.cfg, "generate")
    finally:
        summary["server"] = server.info()
        summary["smoke_chat"] = server.smoke.to_dict() if server.smoke else None
        server.stop()  # one server at a time: extract (vllm backend) and verify start their own


# Stages with a task module of their own (richer artifacts), and the target folder argument
# each takes; every other registry stage runs through tasks/stage.py's generic task.
TASKS: dict[str, tuple[Any, str | None]] = {
    "extract": (extract_task, "model_path"),
    "vocab": (vocab_task, None),
    "train": (train_task, "target_dir"),
    "verify": (verify_task, "model"),
}


def _needed(selected: set[str]) -> set[str]:
    """The selected stages and the inputs they read (a left-out input: its latest artifact)."""
    return set(selected).union(*(stages.STAGES[s].inputs for s in selected))


def _later_stages(run: _HeroRun, summary: dict[str, Any]) -> None:
    """Every registry stage after generate, in pipeline order, that the selection needs."""
    needed = _needed(run.selected)
    for name in list(stages.STAGES)[1:]:
        if name not in needed:
            continue
        if name in TASKS:
            task, model_arg = TASKS[name]
            kwargs = {model_arg: run.model} if model_arg else {}
        else:
            task = stage_task.with_options(name=name)
            kwargs = {"model": run.model, "stage_name": name}
        run.calls[name] = run.stage(name, task, **kwargs)
    if "verify" in run.calls:
        summary["acceptance_length"] = run.calls["verify"].result.get("acceptance_length")


def _record_failure(run: _HeroRun, summary: dict[str, Any], e: BaseException) -> None:
    summary["failed"] = {"stage": run.current, "error": f"{type(e).__name__}: {e}"[:2000]}
    if run.current == "verify":  # a failed gate still wrote its report: show it
        report = run.cfg.paths.artifact_dir(
            "verify", stages.stage_key(run.cfg, "verify", {"train": run.calls["train"].key})
        )
        summary["verify_report"] = (
            str(report / "report.md") if (report / "report.md").exists() else None
        )


def _finish_summary(run: _HeroRun, summary: dict[str, Any], started: float) -> None:
    """Every stage's entry (the failed one included), the wall time, and the report."""
    for name, call in run.calls.items():
        summary["stages"][name] = {
            **call.to_dict(),
            "info": {k: v for k, v in call.result.items() if k != "task"},
        }
    if summary["failed"]:
        summary["stages"][summary["failed"]["stage"]] = {
            "status": "failed",
            "key": None,
            "dir": None,
            "state": "Failed",
            "task_wall_s": 0,
            "lib_wall_s": 0,
            "overhead_s": 0,
            "info": {},
        }
    summary["wall_s"] = round(time.monotonic() - started, 2)
    try:
        write_report(run.cfg, summary)
    except Exception as report_error:  # noqa: BLE001 - never hide the run's own error behind this
        get_run_logger().warning("could not write the hero-run report: %s", report_error)


def dry_run(params: HeroRunParams) -> dict[str, Any]:
    """What ``hero_run(params)`` would do and what would stop it here; no Prefect, nothing started.

    Exits with status 1 when a pre-flight check fails."""
    from eagle3.plan import build_plan
    from eagle3.preflight import preflight, render

    cfg = load_params(params)
    plan = build_plan(cfg)
    forced = stages.dependants(params.force) & set(params.stages)
    print(f"Dry run of profile {cfg.name} (run dir {cfg.paths.run_dir}); nothing is started.")
    read = _needed(set(params.stages)) | {"generate"}  # generate: always, its latest if left out
    for name in stages.STAGES:
        if name in params.stages:
            what = "recompute" if name in forced else "run, or reuse a complete cached artifact"
        else:
            what = "use the latest artifact" if name in read else "skip (nothing selected reads it)"
        print(f"  {name:<8} {what}")
    for label, server in (
        ("serve", plan["stages"]["serve"]["server"]),
        ("extract", plan["stages"]["extract"].get("server")),
        ("verify (speculative)", plan["stages"]["verify"]["speculative server"]),
    ):
        if server and "command" in server:
            print(f"{label} server ({server['backend']}): {server['command']}")
    draft = plan["stages"]["train"]["draft"]
    print(
        f"draft: {draft['arch']}, {draft.get('parameters', {}).get('summary', draft.get('note'))}"
    )
    checks = preflight(cfg)
    print("pre-flight:\n" + render(checks))
    failed = [c.name for c in checks if c.status == "fail"]
    if failed:
        raise SystemExit(
            f"dry run: {len(failed)} pre-flight check(s) failed ({', '.join(failed)}): "
            "fix them before the hero run"
        )
    return {"plan": plan, "checks": [c.__dict__ for c in checks]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", "-c", "--profile", dest="profile", default=DEFAULT_PROFILE)
    ap.add_argument(
        "--set", "-s", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE"
    )
    ap.add_argument(
        "--stages",
        default=",".join(ALL_STAGES),
        help="comma-separated subset of " + ",".join(ALL_STAGES),
    )
    ap.add_argument(
        "--force",
        default="",
        help="comma-separated stages to recompute (with everything after them)",
    )
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="load and validate the profile, print the stages and the pre-flight checks; "
        "run nothing",
    )
    args = ap.parse_args(argv)

    def split(text: str) -> list[str]:
        return [s for s in text.split(",") if s]

    params = HeroRunParams(
        profile=args.profile,
        overrides=args.overrides,
        stages=split(args.stages),
        force=split(args.force),
    )
    if args.dry_run:
        return dry_run(params)
    summary = hero_run(params)
    print_summary(summary)
    return summary


if __name__ == "__main__":
    main()
