"""Which k: the verify stage's k sweep against serving EVERY k (issue 31), on vLLM CPU.

Runs the verify stage with ``verify.sweep_measure_all``: the stage's own steps (the largest and
the smallest k, then its predicted best, at most ``verify.sweep_servers`` per method), then every
other k too, each measured against the prediction the stage ended with. Prints, per method and
concurrency, tokens/s predicted and measured for every k, and whether the predicted best is within
5% of the measured best. The report (report.md, report.png with tokens/s by k and acceptance per
MT-bench category) is in OUT.

    .venv/bin/python bench/verify_sweep.py --draft DIR --out OUT [-c configs/smollm2-cpu.yaml] \\
        [--ks 1 2 3 4 5] [--prompts 20] [--set section.field=value ...]

``--replay SWEEP_JSON [--servers N]`` reruns only the stage's choice on a saved run's
measurements (no vLLM, a second): the stage's current prediction code picks its ks from the
tokens/s the run measured at those ks, and the rows compare its predicted best with the measured
best as above. It checks a change to the prediction against every k measured, without the 30-40
minutes of serving each k again (noise included: it replays one run's measurements).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def summarize(report: dict) -> list[dict]:
    """One row per method and concurrency: the predicted best k, the measured best, the gap."""
    rows = []
    for name in ("draft", "parallel", "ngram"):
        m = report["sweep"].get(name)
        if not m:
            continue
        for c, pred in m["predicted_tokens_per_s"].items():
            meas = {k: s[c] for k, s in m["measured_tokens_per_s"].items() if c in s}
            kp = max(pred, key=lambda k: pred[k])
            km = max(meas, key=lambda k: meas[k])
            rows.append(
                {
                    "method": name,
                    "concurrency": int(c),
                    "served_by_the_stage": m.get("served_by_the_stage")
                    or m["served"][: report["sweep_servers"]],
                    "predicted": {k: round(v, 2) for k, v in pred.items()},
                    "measured": {k: round(v, 2) for k, v in meas.items()},
                    "predicted_best_k": int(kp),
                    "measured_best_k": int(km),
                    # what serving the predicted best costs against the measured best
                    "predicted_best_vs_measured_best": meas[kp] / meas[km] if kp in meas else None,
                    "within_5pct": kp in meas and meas[kp] >= 0.95 * meas[km],
                    "baseline_tokens_per_s": report["sweep"]["baseline_tokens_per_s"][c],
                }
            )
    return rows


def replay(saved: dict, servers: int) -> list[dict]:
    """The stage's choice (eagle3.verify.sweep.run_sweep) on ``saved``'s measurements: each k
    "served" returns the tokens/s the saved run measured there."""
    from eagle3.verify.sweep import run_sweep

    rows = {(r["method"], r["concurrency"]): r for r in saved["rows"]}
    base = {c: r["baseline_tokens_per_s"] for (m, c), r in rows.items() if m == "draft"}
    sweep: dict = {"baseline_tokens_per_s": {str(c): s for c, s in base.items()}}
    for name, al in saved["acceptance_length"].items():
        measured = {
            int(k): {c: rows[name, c]["measured"][k] for c in base}
            for k in rows[name, 1]["measured"]
        }
        sw = run_sweep(
            name,
            sorted(measured),
            {int(k): v for k, v in al.items()},
            base,
            lambda k, measured=measured: (measured[k], {}),
            servers=servers,
            measure_all=True,
            log=lambda m: None,
        )
        sweep[name] = sw.to_dict()
    return summarize({"sweep": sweep, "sweep_servers": servers})


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-c", "--config", default=str(ROOT / "configs" / "smollm2-cpu.yaml"))
    ap.add_argument("--draft")
    ap.add_argument("--out")
    ap.add_argument("--replay", help="a saved sweep.json: rerun the stage's choice on it")
    ap.add_argument("--servers", type=int, default=3, help="with --replay: verify.sweep_servers")
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--set", action="append", default=[], dest="sets")
    a = ap.parse_args(argv)
    if a.replay:
        rows = replay(json.loads(Path(a.replay).read_text()), a.servers)
        for r in rows:
            print(json.dumps(r))
        ok = sum(r["within_5pct"] for r in rows)
        print(f"predicted best within 5% of the measured best: {ok} of {len(rows)}")
        return
    if not (a.draft and a.out):
        ap.error("--draft and --out (or --replay)")

    from eagle3.config import load_config
    from eagle3.embedded import resolve_model
    from eagle3.verify import GateFailed, verify

    out = Path(a.out)
    overrides = [
        f"paths.runs_dir={out / 'runs'}",
        f"verify.num_speculative_tokens={json.dumps(a.ks)}",
        f"verify.num_prompts={a.prompts}",
        "verify.sweep_measure_all=true",
        "verify.min_acceptance_length=1.0",
        "serve.port=0",
        *a.sets,
    ]
    cfg = load_config(a.config, overrides)
    os.environ.setdefault("EAGLE3_VLLM_PYTHON", str(ROOT / ".venv-vllm" / "bin" / "python"))
    model = resolve_model(cfg.target.model, cfg.paths.cache_dir)
    t0 = time.time()
    try:
        report = verify(cfg, str(model), a.draft, out / "verify")
    except GateFailed:
        report = json.loads((out / "verify" / "report.json").read_text())
    report["sweep_servers"] = cfg.verify.sweep_servers
    rows = summarize(report)
    result = {
        "config": a.config,
        "draft": a.draft,
        "ks": a.ks,
        "conversations": report["workload"]["conversations"],
        "turns": report["workload"]["turns"],
        "max_tokens": report["max_tokens"],
        "wall_s": round(time.time() - t0, 1),
        # what the stage predicted from, per method (what --replay needs)
        "acceptance_length": {
            name: m["acceptance_length"]
            for name, m in report["sweep"].items()
            if isinstance(m, dict) and "acceptance_length" in m
        },
        "offline_acceptance_by_k": {
            k: round(o["acceptance_length"], 3)
            for k, o in ((report.get("offline") or {}).get("by_k") or {}).items()
        },
        "serving": {
            c: {
                "draft_k": e["num_speculative_tokens"],
                "draft_tokens_per_s": round(e["tokens_per_s"], 2),
                "ngram_k": (e.get("ngram") or {}).get("num_speculative_tokens"),
                "ngram_tokens_per_s": round((e.get("ngram") or {}).get("tokens_per_s") or 0, 2),
            }
            for c, e in report["serving"].items()
        },
        "rows": rows,
        "report": str(out / "verify" / "report.md"),
    }
    (out / "sweep.json").write_text(json.dumps(result, indent=1))
    for r in rows:
        print(json.dumps(r))
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))


if __name__ == "__main__":
    main()
