"""A stage's keyed folder around its Prefect task: trust it, resume it or clear it before the task
runs, check it was sealed after, and the latest artifact of a stage the run leaves out; and one
hero run per profile at a time."""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from prefect import get_run_logger

from eagle3 import artifacts
from eagle3.config import PipelineConfig
from eagle3.errors import FolderBusy
from eagle3.writer_lock import refuse_if_held, writer_lock
from tasks.caching import StageCall, call_stage


def use_latest(cfg: PipelineConfig, stage: str) -> StageCall:
    """A stage the run leaves out: its latest complete artifact, or an error saying to run it."""
    found = artifacts.latest(cfg, stage)
    if found is None:
        raise RuntimeError(
            f"stage {stage} is not in this run's stages and {cfg.paths.stage_root(stage)} has no "
            f"complete latest artifact: run {stage} first"
        )
    d, m = found
    return StageCall(stage, m["key"], str(d), "latest", m.get("result") or {})


def prepare_folder(stage: str, out_dir: Path, key: str, forced: set[str]) -> bool:
    """Whether the cached result must be refreshed; clears what cannot be trusted.

    A complete folder is a hit. A folder that never finished (no artifact.json) is resumed: every
    stage continues where it stopped. A finished folder that lost or changed files is rebuilt
    from scratch (a resume would trust its own bookkeeping), except generate, whose resume reads
    the samples themselves and so requests exactly the ones that are gone.
    """
    logger = get_run_logger()
    refuse_if_held(out_dir, stage)  # another run writes it: clearing it would pull it away
    if stage in forced:
        if out_dir.exists():
            logger.info("%s: forced, clearing %s", stage, out_dir)
            shutil.rmtree(out_dir)
        return True
    issues = artifacts.problems(out_dir, key)
    if not issues:
        return False
    if out_dir.exists():
        sealed = artifacts.read_marker(out_dir) is not None
        if sealed and stage != "generate":
            logger.warning("%s: %s; rebuilding it", stage, "; ".join(issues[:3]))
            shutil.rmtree(out_dir)
        else:
            (out_dir / artifacts.MARKER).unlink(missing_ok=True)
            logger.info("%s: resuming in %s (%s)", stage, out_dir, issues[0])
    return True


def run_stage_task(
    stage: str,
    task: Any,
    cfg: PipelineConfig,
    key: str,
    forced: set[str],
    refresh: bool | None = None,
    **kwargs: Any,
) -> StageCall:
    """``task`` on the stage's keyed folder (prepared first), which must come back sealed; it
    becomes the stage's ``latest``."""
    out_dir = cfg.paths.artifact_dir(stage, key)
    if refresh is None:
        refresh = prepare_folder(stage, out_dir, key, forced)
    # the task runs the stage through eagle3.stages.run_stage, which seals the folder
    call = call_stage(task, cfg, stage, out_dir, refresh, **kwargs)
    if artifacts.read_marker(out_dir) is None:
        raise RuntimeError(f"{stage}: {out_dir} has no {artifacts.MARKER} after the task")
    artifacts.set_latest(cfg, stage, key)
    call.result = {**(artifacts.read_marker(out_dir) or {}).get("result", {}), "task": call.result}
    return call


@contextlib.contextmanager
def one_run_per_profile(
    cfg: PipelineConfig, log: Callable[[str], None], poll_s: float = 5.0, say_every_s: float = 600
) -> Iterator[None]:
    """Hold the profile's run folder for the whole hero run; a second run waits (queues) until the
    first ends, and says in its log (the UI's run page) whom it waits for.

    Why: runs of one profile share their keyed folders, and a nightly regeneration overlapping a
    run started from the UI wrote 250 records for 200 prompts (issue #39). The stage folders' own
    locks would make the second run fail mid-way; waiting here is what a queue does. The lock is
    ``eagle3.writer_lock`` on ``<run dir>`` (released by the kernel if the run's process dies), so
    it holds across deployments, workers and runs started from the shell on one file system.
    """
    waited_since, said = None, 0.0
    with contextlib.ExitStack() as held:
        while True:
            try:
                held.enter_context(writer_lock(cfg.paths.run_dir, "hero"))
                break
            except FolderBusy as e:
                now = time.monotonic()
                waited_since = waited_since or now
                if said == 0.0 or now - said >= say_every_s:
                    log(
                        f"waiting: {e}. Runs of one profile share its folders: this run starts "
                        "when that one ends (cancel this run to give up)"
                    )
                    said = now
            time.sleep(poll_s)
        if waited_since is not None:
            log(f"{cfg.paths.run_dir} is free after {time.monotonic() - waited_since:.0f} s")
        yield
