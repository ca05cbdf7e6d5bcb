"""Fault trials of `eagle3 generate` against a real vLLM server (issue #16).

    .venv/bin/python bench/faults.py [--config configs/smollm2-cpu.yaml] [--prompts 400] [--kills 20]

1. kill -9 trial: `eagle3 generate --base-url` (one vLLM server started here, shared) is killed
   with SIGKILL at a random moment after it started writing, ``--kills`` times, each time resumed;
   then run to the end. Reported: kills, samples lost (seen before a kill, missing after), duplicated,
   unreadable lines, token ids differing from an uninterrupted run of the same prompts, and
   processes left behind after each kill.
2. SIGTERM trial: `eagle3 generate` with its own server (process backend) gets SIGTERM while the
   server starts, SIGTERM and SIGINT while it loads (its API server runs), SIGTERM mid-run, and
   SIGINT mid-run. Reported per signal: exit code, the
   message, processes of the server's group (and any new vLLM process) left after the exit.
   The folder is then completed against the shared server: nothing lost or duplicated.

3. Canned-ids trial (issue #30): `eagle3 generate` at concurrency 32 against bench/zero_server.py
   (canned token ids, no /tokenize), twice, for the embedded target and for a local-folder target
   (``target.model`` = the prepared folder, ``target.tokenizer`` unset); then against the shared
   vLLM server into the same folder. Reported: samples stored with ids that are not the local
   tokenizer's after each run, "Task exception was never retrieved" tracebacks, exit codes.
4. Clarity trial (issue #30): the cases that used to confuse a user, each one CLI command:
   ``embedded:nope``, a wrong ``target.served_model_name`` on a running server, a missing dataset
   file (no --base-url: a server would be started), a dataset with no usable row (0 samples), a
   generate record without ``prompt_token_ids`` read by extract. Reported per case: exit code,
   seconds, lines on stderr, whether a traceback was printed, the first line.

Processes that existed before the bench started (another user's servers) are never counted or
touched. Orphans must be 0.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from eagle3.config import load_config
from eagle3.embedded import prepare_model
from eagle3.generate.storage import iter_samples
from eagle3.serving.process import group_members
from eagle3.serving.readiness import free_port
from eagle3.serving.server import start_server

ROOT = Path(__file__).resolve().parent.parent
BASELINE: set[int] = set()  # pids alive when the bench started: not ours


def processes(*needles: str) -> list[int]:
    """Pids (not in BASELINE, not this process) whose command line contains every needle."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in BASELINE or int(entry) == os.getpid():
            continue
        try:
            cmd = (
                Path(f"/proc/{entry}/cmdline")
                .read_bytes()
                .replace(b"\0", b" ")
                .decode(errors="replace")
            )
        except OSError:
            continue
        if all(n in cmd for n in needles):
            found.append(int(entry))
    return found


def read_folder(out: Path) -> tuple[list[str], int, dict[str, list[int]]]:
    """(ids in storage order, unreadable lines, id -> completion ids)."""
    bad: list[str] = []
    ids, tokens = [], {}
    for s in iter_samples(out, on_bad=lambda where, reason: bad.append(where)):
        ids.append(s["id"])
        tokens[s["id"]] = s["prompt_token_ids"] + s["completion_token_ids"]
    return ids, len(bad), tokens


def cli(config: str, out: Path, sets: list[str], base_url: str | None) -> list[str]:
    argv = [sys.executable, "-m", "eagle3.cli", "generate", "-c", config, "--out", str(out)]
    if base_url:
        argv += ["--base-url", base_url]
    for s in sets:
        argv += ["--set", s]
    return argv


def orphans_of_cli(work: Path) -> list[int]:
    """A generate of this bench (its command line names the bench's folder) still alive after it was
    killed or exited. (With --base-url it starts no server; the signal trial checks the server's group.)"""
    return processes("eagle3.cli", str(work))


def kill_trial(args, sets: list[str], base_url: str, work: Path) -> dict:
    out = work / "killed"
    rng = random.Random(args.seed)
    kills, finished_runs, orphans, seen = 0, 0, 0, set()
    while kills < args.kills:
        before = len(read_folder(out)[0]) if out.exists() else 0
        proc = subprocess.Popen(
            cli(args.config, out, sets, base_url),
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        while proc.poll() is None and (len(read_folder(out)[0]) if out.exists() else 0) <= before:
            time.sleep(0.05)  # wait until this run writes: the kill must land mid-run
        time.sleep(rng.uniform(0.0, args.max_kill_delay_s))
        if proc.poll() is not None:
            finished_runs += 1
            break  # the prompts ran out before the kills did
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        kills += 1
        time.sleep(0.2)
        left = orphans_of_cli(work)
        orphans += len(left)
        ids, _, _ = read_folder(out)
        seen |= set(ids)
        print(f"  kill {kills:2d}: {len(ids)} samples stored, orphans {len(left)}", flush=True)
    done = subprocess.run(
        cli(args.config, out, sets, base_url), cwd=ROOT, capture_output=True, text=True
    )
    ids, unreadable, tokens = read_folder(out)
    reference = work / "reference"
    subprocess.run(
        cli(args.config, reference, sets, base_url),
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    ref_ids, _, ref_tokens = read_folder(reference)
    return {
        "kills": kills,
        "runs_that_finished_before_their_kill": finished_runs,
        "final_exit": done.returncode,
        "samples": len(set(ids)),
        "expected": len(set(ref_ids)),
        "lost": len(seen - set(ids)),
        "missing_vs_uninterrupted": len(set(ref_ids) - set(ids)),
        "duplicated": len(ids) - len(set(ids)),
        "unreadable_lines": unreadable,
        "token_ids_differ_from_uninterrupted": sum(
            tokens.get(i) != t for i, t in ref_tokens.items()
        ),
        "orphaned_processes": orphans,
    }


def signal_trial(args, sets: list[str], work: Path, sig: int, when: str) -> dict:
    out = work / "signalled"
    port = free_port()
    proc = subprocess.Popen(
        cli(
            args.config, out, [*sets, f"serve.port={port}", f"paths.runs_dir={work / 'runs'}"], None
        ),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    before = len(read_folder(out)[0]) if out.exists() else 0
    deadline = time.monotonic() + 600
    server: list[int] = []
    while proc.poll() is None and time.monotonic() < deadline:
        server = server or processes("--port", str(port))
        if server and when == "loading":  # vLLM's API server runs (its own handlers are up)
            logs = (work / "runs").rglob(f"vllm-{port}-*.log")
            if any("(APIServer pid=" in p.read_text() for p in logs):
                time.sleep(2)
                break
        elif server and (
            when == "starting" or (out.exists() and len(read_folder(out)[0]) > before)
        ):
            break
        time.sleep(0.1)
    if when == "mid-run":
        time.sleep(random.uniform(0.0, args.max_kill_delay_s))
    group = set(server) | {p for pid in server for p in group_members(pid)}
    t0 = time.monotonic()
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=300)
    exit_s = time.monotonic() - t0
    time.sleep(0.5)
    left = sorted({p for pid in server for p in group_members(pid)} | set(orphans_of_cli(work)))
    message = next(
        (ln for ln in err.splitlines() if ln.startswith("interrupted")),
        err.strip().splitlines()[-1:],
    )
    return {
        "signal": signal.Signals(sig).name,
        "when": when,
        "exit_code": proc.returncode,
        "exit_s": round(exit_s, 1),
        "server_pids_seen": len(group),
        "samples_saved": len(read_folder(out)[0]),
        "orphaned_processes": len(left),
        "message": message,
        "stop_message": next((ln for ln in err.splitlines() if "still loading" in ln), None),
    }


def wrong_ids(out: Path, model: str) -> tuple[int, int]:
    """(samples, samples whose prompt ids are not the local tokenizer + chat template's)."""
    from transformers import AutoTokenizer

    from eagle3.tokens import template_prompt_ids

    if not out.exists():
        return 0, 0
    tok = AutoTokenizer.from_pretrained(model)
    samples = list(iter_samples(out, on_bad=lambda *_: None))
    return len(samples), sum(
        template_prompt_ids(tok, s["messages"]) != s["prompt_token_ids"] for s in samples
    )


def canned_ids_trial(args, sets: list[str], right_url: str, work: Path, model: str, local: bool):
    """Two refused runs against canned ids at concurrency 32, then the right server."""
    name = "local-folder" if local else "embedded"
    out = work / f"canned-{name}"
    cfg = load_config(args.config)
    sets = [
        *[x for x in sets if not x.startswith(("generate.concurrency", "generate.dataset"))],
        f"generate.dataset={work / 'canned-prompts.jsonl'}",
        "generate.concurrency=32",
        *([f"target.model={model}"] if local else []),
    ]
    port = free_port()
    zero = subprocess.Popen(
        [sys.executable, str(ROOT / "bench" / "zero_server.py"), str(port)]
        + [cfg.target.served_model_name],
        stdout=subprocess.PIPE,
    )
    zero.stdout.readline()
    runs = []
    try:
        for _ in range(2):
            r = subprocess.run(
                cli(args.config, out, sets, f"http://127.0.0.1:{port}"),
                cwd=ROOT,
                capture_output=True,
                text=True,
            )
            n, bad = wrong_ids(out, model)
            runs.append(
                {
                    "exit": r.returncode,
                    "stored": n,
                    "wrong_ids": bad,
                    "never_retrieved_tracebacks": r.stderr.count("never retrieved"),
                    "message": next((ln for ln in r.stderr.splitlines() if "error" in ln), ""),
                }
            )
    finally:
        zero.kill()
        zero.wait()
    r = subprocess.run(cli(args.config, out, sets, right_url), cwd=ROOT, capture_output=True)
    n, bad = wrong_ids(out, model)
    return {
        "target": name,
        "canned_runs": runs,
        "right_server": {"exit": r.returncode, "samples": n, "wrong_ids": bad},
    }


def clarity_case(case: str, argv: list[str], **check) -> dict:
    t0 = time.monotonic()
    r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=900)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith("generate ")]
    out = {
        "case": case,
        "exit": r.returncode,
        "seconds": round(time.monotonic() - t0, 1),
        "stderr_lines": len(lines),
        "traceback": "Traceback" in r.stderr,
        "first_line": (lines or [""])[0][:200],
        **{k: f(r) for k, f in check.items()},
    }
    print(json.dumps(out), flush=True)
    return out


def clarity_trial(args, sets: list[str], right_url: str, work: Path, model: str) -> list[dict]:
    cfg = load_config(args.config)
    runs = f"paths.runs_dir={work / 'clarity-runs'}"
    bad_rows = work / "no-usable-row.jsonl"
    bad_rows.write_text('{"nothing": 1}\n{"prompt": ""}\n')
    gen = work / "no-prompt-ids"  # a generate folder with one record that lost its prompt ids
    shutil.copytree(work / "canned-embedded", gen)
    shard = sorted(gen.glob("samples-*.jsonl"))[0]
    records = shard.read_text().splitlines()
    first = json.loads(records[0])
    del first["prompt_token_ids"]
    shard.write_text("\n".join([json.dumps(first), *records[1:]]) + "\n")
    ext = [sys.executable, "-m", "eagle3.cli", "extract", "-c", args.config]
    return [
        clarity_case(
            "target.model=embedded:nope",
            cli(args.config, work / "nope", [*sets, runs, "target.model=embedded:nope"], right_url),
        ),
        clarity_case(
            "wrong target.served_model_name on a running server (serve.backend=external)",
            cli(
                args.config,
                work / "wrong-name",
                [*sets, runs, "serve.backend=external", f"serve.base_url={right_url}"]
                + ["target.served_model_name=nope"],
                None,
            ),
        ),
        clarity_case(
            "missing dataset file (the command would start its own server)",
            cli(args.config, work / "missing", [runs, "generate.dataset=/nonexistent.jsonl"], None),
            server_started=lambda r: (work / "clarity-runs" / cfg.name / "serve").exists(),
        ),
        clarity_case(
            "a dataset with no usable row (0 samples)",
            cli(
                args.config, work / "zero", [*sets, runs, f"generate.dataset={bad_rows}"], right_url
            ),
            sealed=lambda r: (work / "zero" / "manifest.json").exists(),
        ),
        clarity_case(
            "a generate record without prompt_token_ids, read by extract",
            ext
            + ["--generate-dir", str(gen), "--out", str(work / "ext"), "--set", runs]
            + ["--set", "extract.backend=hf"],
            summary=lambda r: r.stdout.strip().splitlines()[-1:],
        ),
    ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/smollm2-cpu.yaml")
    ap.add_argument("--prompts", type=int, default=400)
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--max-kill-delay-s", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-signals", action="store_true")
    ap.add_argument(
        "--trials",
        default="kill,signals,canned,clarity",
        help="Comma-separated: kill, signals, canned (issue #30's canned ids), clarity.",
    )
    ap.add_argument("--canned-prompts", type=int, default=40)
    ap.add_argument(
        "--signal-cases", help="e.g. SIGTERM:loading,SIGINT:mid-run (default: all five)"
    )
    ap.add_argument("--out", help="Write the JSON results here too.")
    args = ap.parse_args()
    BASELINE.update(int(p) for p in os.listdir("/proc") if p.isdigit())
    work = Path(tempfile.mkdtemp(prefix="bench-faults-"))
    data = work / "prompts.jsonl"
    data.write_text(
        "".join(
            json.dumps({"prompt": f"Give one short fact about the number {i}."}) + "\n"
            for i in range(args.prompts)
        )
    )
    sets = [
        f"generate.dataset={data}",
        "generate.num_samples=null",
        f"generate.max_tokens={args.max_tokens}",
        "generate.concurrency=8",
        "generate.shard_size=50",
    ]
    cfg = load_config(args.config)
    model = (
        str(prepare_model(cfg.paths.cache_dir, cfg.target.embedded_name))
        if cfg.target.is_embedded
        else cfg.target.model
    )
    print(
        f"machine: {platform.node()}, {os.cpu_count()} cores; {time.strftime('%Y-%m-%d %H:%M')}; "
        f"profile {cfg.name}; {args.prompts} prompts, max_tokens {args.max_tokens}; work {work}",
        flush=True,
    )
    results: dict = {}
    t0 = time.monotonic()
    trials = set(args.trials.split(","))
    (work / "canned-prompts.jsonl").write_text(
        "".join(
            json.dumps({"prompt": f"Name one fact about the number {i}."}) + "\n"
            for i in range(args.canned_prompts)
        )
    )
    with start_server(cfg, model, log_dir=work / "serve") as server:
        if "kill" in trials:
            results["kill_9"] = kill_trial(args, sets, server.base_url, work)
            print(json.dumps(results["kill_9"]), flush=True)
        if "canned" in trials or "clarity" in trials:
            results["canned_ids"] = [
                canned_ids_trial(args, sets, server.base_url, work, model, local)
                for local in (False, True)
            ]
            for r in results["canned_ids"]:
                print(json.dumps(r), flush=True)
        if "clarity" in trials:
            results["clarity"] = clarity_trial(args, sets, server.base_url, work, model)
        if "signals" in trials and not args.skip_signals:
            cases = [
                (signal.SIGTERM, "starting"),
                (signal.SIGTERM, "loading"),  # issue #30: waited serve.stop_timeout_s, silent
                (signal.SIGINT, "loading"),
                (signal.SIGTERM, "mid-run"),
                (signal.SIGINT, "mid-run"),
            ]
            chosen = args.signal_cases.split(",") if args.signal_cases else None
            results["signals"] = [
                signal_trial(args, sets, work, sig, when)
                for sig, when in cases
                if chosen is None or f"{signal.Signals(sig).name}:{when}" in chosen
            ]
            for r in results["signals"]:
                print(json.dumps(r), flush=True)
            done = subprocess.run(
                cli(args.config, work / "signalled", sets, server.base_url),
                cwd=ROOT,
                capture_output=True,
                text=True,
            )
            ids, unreadable, _ = read_folder(work / "signalled")
            results["signals_resumed"] = {
                "exit": done.returncode,
                "samples": len(set(ids)),
                "duplicated": len(ids) - len(set(ids)),
                "unreadable_lines": unreadable,
            }
        shared = server.pid
    time.sleep(1)
    results["orphans_at_end"] = len(group_members(shared)) + len(orphans_of_cli(work))
    results["wall_s"] = round(time.monotonic() - t0, 1)
    print(json.dumps(results, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
