"""What Prefect and the caching cost: an unchanged rerun of a finished hero run, and Prefect's
overhead per stage.

    .venv/bin/python bench/orchestration.py [--config configs/smollm2-cpu.yaml] [--set k=v ...]
                                            [--repeats 3] [--json out.json]

1. A finished hero run of the profile: the last run's ``hero-run.json`` in the run dir (after
   ``make demo``), or the hero run is run now (``--prepare``, which is ``make demo``'s work).
   From the last run in which stages ran: per stage, the task's wall time as the flow saw it,
   the library call's wall time inside the task, and the difference, Prefect's overhead
   (task run creation, state changes, result persistence, artifacts).
2. Unchanged reruns, every stage a cache hit (the goal: under 30 s):
   - ``cli``: ``python -m flows.hero_run --config ...`` as a user types it (interpreter start,
     imports, Prefect's temporary server, the flow), once;
   - ``in-process``: the flow called again in one process against a running Prefect server
     (Prefect's test harness: a temporary server and database), ``--repeats`` times.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from eagle3 import PROJECT_ROOT as ROOT
from eagle3.stages import NAMES as STAGES
from flows.hero_run import HeroRunParams, hero_run, load_params


def _statuses(summary: dict) -> dict[str, str]:
    return {s: c["status"] for s, c in summary["stages"].items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", "-c", default="configs/smollm2-cpu.yaml")
    ap.add_argument("--set", "-s", dest="overrides", action="append", default=[])
    ap.add_argument("--stages", default=",".join(STAGES))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--prepare", action="store_true", help="run the hero run first if it has not finished"
    )
    ap.add_argument("--json", type=Path, help="also write the numbers here")
    args = ap.parse_args()
    params = HeroRunParams(
        profile=args.config, overrides=args.overrides, stages=args.stages.split(",")
    )
    cfg = load_params(params)
    last = cfg.paths.run_dir / "hero-run.json"

    from prefect.testing.utilities import prefect_test_harness

    out: dict = {
        "profile": cfg.name,
        "run_dir": str(cfg.paths.run_dir),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    with prefect_test_harness(server_startup_timeout=120):
        summary = json.loads(last.read_text()) if last.is_file() else None
        if summary is None or summary.get("failed"):
            if not args.prepare:
                sys.exit(f"{last}: no finished hero run; run `make demo` first or pass --prepare")
            t0 = time.perf_counter()
            summary = hero_run(params)
            out["prepare_wall_s"] = round(time.perf_counter() - t0, 1)
        # the overhead comes from the last run in which stages ran (run this right after `make demo`)
        out["stages_ran"] = {
            s: {k: c[k] for k in ("status", "task_wall_s", "lib_wall_s", "overhead_s")}
            for s, c in summary["stages"].items()
            if c["status"] == "ran"
        }

        walls = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            again = hero_run(params)
            walls.append(time.perf_counter() - t0)
            assert set(_statuses(again).values()) == {"cached"}, _statuses(again)
            assert again["server"] is None
        out["in_process_rerun_s"] = [round(w, 3) for w in walls]
        out["cached_task_wall_s"] = {s: c["task_wall_s"] for s, c in again["stages"].items()}

    cmd = [sys.executable, "-m", "flows.hero_run", "--config", args.config, "--stages", args.stages]
    for o in args.overrides:
        cmd += ["--set", o]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    out["cli_rerun_s"] = round(time.perf_counter() - t0, 2)
    if r.returncode != 0:
        sys.exit(f"CLI rerun failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    out["cli_last_line"] = r.stdout.strip().splitlines()[-1]

    print(f"\nHero run {cfg.name} ({cfg.paths.run_dir}), {out['cpus']} CPUs, {out['date']}")
    if out["stages_ran"]:
        print("\nLast run in which stages ran: Prefect's overhead per stage")
        print("| stage | task wall | library call | Prefect overhead |\n|---|---|---|---|")
        for s, c in out["stages_ran"].items():
            print(
                f"| {s} | {c['task_wall_s']:.2f} s | {c['lib_wall_s']:.2f} s | {c['overhead_s']:.3f} s |"
            )
    print("\nUnchanged rerun (every stage a cache hit, no server started)")
    print(
        f"- CLI (`python -m flows.hero_run`, temporary Prefect server included): {out['cli_rerun_s']} s"
    )
    print(
        f"- in-process against a running Prefect server: median {statistics.median(walls):.2f} s "
        f"({', '.join(f'{w:.2f}' for w in walls)})"
    )
    print(f"- per cached stage (task call): {out['cached_task_wall_s']}")
    print(f"- the CLI's last line: {out['cli_last_line']}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
