"""Serve the hero-run deployments to a Prefect server (what `make ui` runs after starting one).

    PREFECT_API_URL=http://127.0.0.1:4200/api python -m flows.serve
        [--profile configs/smollm2-cpu.yaml] [--set section.field=value ...]
        [--stages generate,extract,vocab,train] [--timezone Europe/Berlin]
        [--only hero-run]

Deployments (all of the one flow ``hero-run``; the UI shows each with a form for its parameters):

- ``hero-run``: the whole pipeline of the profile (cached stages are reused).
- ``generate``, ``extract``, ``vocab``, ``train``, ``verify``: one stage on the latest artifacts
  of the others ("train on the latest artifacts").
- ``nightly-regeneration``: the whole pipeline at 02:00 every day (cron ``0 2 * * *`` in the
  given timezone). Generate requests only new prompts and those that failed; the later stages
  run only if that changed the data (otherwise their keys are unchanged: cache hits).

The runner started here executes the runs itself, one at a time (``--limit 1``): runs of one
profile share a run folder. For production, deploy/prefect.yaml declares the same deployments
for a process work pool and a worker (deploy/systemd/prefect-worker.service).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from prefect import serve
from prefect.schedules import Cron

from flows.hero_run import ALL_STAGES, DEFAULT_PROFILE, HeroRunParams, hero_run

NIGHTLY_CRON = "0 2 * * *"
DEFAULT_TIMEZONE = os.environ.get("EAGLE3_TIMEZONE", "UTC")
DEPLOYMENT_NAMES = ["hero-run", *ALL_STAGES, "nightly-regeneration"]


def deployments(
    profile: str = DEFAULT_PROFILE,
    overrides: list[str] | None = None,
    stages: list[str] | None = None,
    timezone: str = DEFAULT_TIMEZONE,
    only: list[str] | None = None,
) -> list[Any]:
    """The RunnerDeployments of ``hero_run`` (``stages`` sets the hero-run and nightly defaults)."""
    overrides = list(overrides or [])
    full = list(stages or ALL_STAGES)

    def params(stage_list: list[str]) -> dict[str, Any]:
        return {
            "params": HeroRunParams(
                profile=profile, overrides=overrides, stages=stage_list
            ).model_dump()
        }

    out = [
        hero_run.to_deployment(
            name="hero-run",
            parameters=params(full),
            tags=["eagle3", "hero-run"],
            description="The whole pipeline of a profile: generate, extract, vocab, train, verify. "
            "Stages whose "
            "artifacts exist for the same settings and inputs are cache hits.",
        )
    ]
    for stage in ALL_STAGES:
        out.append(
            hero_run.to_deployment(
                name=stage,
                parameters=params([stage]),
                tags=["eagle3", "stage"],
                description=f"Only the {stage} stage, "
                "on the latest artifacts of the stages before it.",
            )
        )
    out.append(
        hero_run.to_deployment(
            name="nightly-regeneration",
            parameters=params(full),
            tags=["eagle3", "nightly"],
            schedules=[Cron(NIGHTLY_CRON, timezone=timezone)],
            description=f"Every day at 02:00 ({timezone}): "
            "generate answers for new and failed prompts; the later "
            "stages rerun only if the data changed.",
        )
    )
    if only:
        unknown = set(only) - set(DEPLOYMENT_NAMES)
        if unknown:
            raise ValueError(f"unknown deployments {sorted(unknown)}; known: {DEPLOYMENT_NAMES}")
        out = [d for d in out if d.name in only]
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", "--config", "-c", default=DEFAULT_PROFILE)
    ap.add_argument(
        "--set", "-s", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE"
    )
    ap.add_argument(
        "--stages", default=",".join(ALL_STAGES), help="default stages of hero-run and nightly"
    )
    ap.add_argument(
        "--timezone", default=DEFAULT_TIMEZONE, help="IANA name for the nightly schedule"
    )
    ap.add_argument(
        "--only", default="", help="comma-separated deployment names to serve (default: all)"
    )
    ap.add_argument("--limit", type=int, default=1, help="flow runs at a time")
    args = ap.parse_args(argv)

    def split(text: str) -> list[str]:
        return [s for s in text.split(",") if s]

    deps = deployments(
        args.profile, args.overrides, split(args.stages), args.timezone, split(args.only) or None
    )
    serve(*deps, pause_on_shutdown=False, limit=args.limit)


if __name__ == "__main__":
    main()
