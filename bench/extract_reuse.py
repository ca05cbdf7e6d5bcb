"""The nightly case for extract: yesterday's samples are extracted, today's data has a few more.
Side by side in one run: extracting today's data from scratch vs reusing yesterday's folder.

    .venv/bin/python bench/extract_reuse.py [--config configs/smollm2-cpu.yaml] [--generate-dir DIR]
                                            [--new 4] [--set k=v ...]

The generate output defaults to the profile's latest (``make demo`` leaves one). "Yesterday" is
that output without its last ``--new`` samples. Prints the wall times, their ratio, and what the
reuse run computed and copied; the copied states are checked bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import torch

from eagle3.config import load_config
from eagle3.embedded import resolve_model
from eagle3.extract.runner import extract
from eagle3.extract.storage import HiddenStateDataset


def first_samples(gen_dir: Path, out: Path, n: int) -> Path:
    """A copy of a generate output with its first ``n`` samples (over all shards, in order)."""
    out.mkdir(parents=True)
    rows = [
        line
        for shard in sorted(gen_dir.glob("samples-*.jsonl"))
        for line in shard.read_text().splitlines()
    ]
    (out / "samples-00000.jsonl").write_text("\n".join(rows[:n]) + "\n")
    m = json.loads((gen_dir / "manifest.json").read_text())
    m["totals"]["samples"] = n
    (out / "manifest.json").write_text(json.dumps(m))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", "-c", default="configs/smollm2-cpu.yaml")
    ap.add_argument("--set", "-s", dest="overrides", action="append", default=[])
    ap.add_argument("--generate-dir", type=Path)
    ap.add_argument("--new", type=int, default=4, help="samples that are new today")
    args = ap.parse_args()
    cfg = load_config(args.config, args.overrides)
    gen = (args.generate_dir or cfg.paths.stage_dir("generate")).resolve()
    if not (gen / "manifest.json").is_file():
        raise SystemExit(
            f"{gen}: no generate output (run `make demo` first, or pass --generate-dir)"
        )
    total = json.loads((gen / "manifest.json").read_text())["totals"]["samples"]
    model = resolve_model(cfg.target.model, cfg.paths.cache_dir)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        old = first_samples(gen, root / "yesterday-generate", total - args.new)
        extract(cfg, old, root / "yesterday", model)
        t0 = time.perf_counter()
        fresh = extract(cfg, gen, root / "fresh", model)
        fresh_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        reused = extract(cfg, gen, root / "reused", model, reuse_from=root / "yesterday")
        reuse_s = time.perf_counter() - t0
        a, b = HiddenStateDataset(root / "yesterday"), HiddenStateDataset(root / "reused")
        by_id = {b[i].id: b[i] for i in range(len(b))}
        exact = all(
            torch.equal(a[i].aux, by_id[a[i].id].aux)
            and torch.equal(a[i].final, by_id[a[i].id].final)
            for i in range(len(a))
        )
    run = reused["this_run"]
    print(
        f"{cfg.name}: extract ({cfg.extract.backend} backend) of {fresh['samples']} samples, "
        f"{fresh['tokens']} tokens, {args.new} of them new; {platform.machine()}, {os.cpu_count()} CPUs, "
        f"{time.strftime('%Y-%m-%d')}"
    )
    print(f"  from scratch: {fresh_s:.2f} s")
    print(
        f"  reusing yesterday's folder: {reuse_s:.2f} s ({run['stored']} computed, {run['reused']} copied, "
        f"copies bit-identical: {exact})"
    )
    print(f"  ratio: {fresh_s / reuse_s:.2f}x")


if __name__ == "__main__":
    main()
