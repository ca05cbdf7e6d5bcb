"""Offline vs online states, side by side in one run on the same samples, seed and recipe.

    .venv/bin/python bench/online.py [--config configs/smollm2-cpu.yaml] [--samples 40]
                                     [--sources hf,vllm] [--cache-gib 0.05] [--set k=v ...]

The samples are the first ``--samples`` of ../shared/data/smollm2-sharegpt (our own generate
stage's answers; ``--generate-dir`` for another folder). Arms: ``offline`` (extract stores the
states, train reads them), then ``online-<source>`` for each source (extract stores tokens only,
train asks the target: ``hf`` in the training process, ``vllm`` the extract server it starts).
Prints per arm: extract and train wall time, the steps' tokens/s, the target's time
(``produce_s``) against the time the step waited for batches (``step_wait_s``: what was not
hidden), the cache's hits and peak bytes, the disk the folders hold, and each online arm's worst
per-step loss difference from the offline run.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.extract_reuse import first_samples  # noqa: E402
from eagle3.config import load_config  # noqa: E402
from eagle3.embedded import resolve_model  # noqa: E402
from eagle3.extract.runner import extract  # noqa: E402
from eagle3.train import train  # noqa: E402
from eagle3.train.state_cache import disk_bytes  # noqa: E402
from eagle3.vocab import vocab_stage  # noqa: E402

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "smollm2-sharegpt"


def losses(train_dir: Path) -> list[float]:
    epochs = json.loads((train_dir / "metrics.json").read_text())["epochs"]
    return [x for e in epochs for x in e["loss"]]


def arm(name: str, cfg, gen: Path, model: str, work: Path, vocab: Path | None) -> dict:
    ext, out = work / f"extract-{name}", work / f"train-{name}"
    t0 = time.perf_counter()
    extract(cfg, gen, ext, model)
    extract_s = time.perf_counter() - t0
    if vocab is None:
        vocab_stage(ext, work / "vocab", cfg.target.vocab_size, cfg.vocab.draft_vocab_size)
        vocab = work / "vocab" / "vocab.safetensors"
    t0 = time.perf_counter()
    m = train(cfg, ext, vocab, model, out)
    train_s = time.perf_counter() - t0
    tokens = sum(e["tokens"] for e in json.loads((out / "metrics.json").read_text())["epochs"])
    row = {
        "arm": name,
        "extract_s": round(extract_s, 1),
        "train_s": round(train_s, 1),
        "loop_s": m["loop_s"],
        "tokens_per_s": round(tokens / m["loop_s"], 1),
        "extract_bytes": disk_bytes(ext),
        "states": m["states"],
        "final_loss": m["final"]["loss"],
    }
    print(json.dumps(row), flush=True)
    return row | {"vocab": vocab, "out": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/smollm2-cpu.yaml")
    ap.add_argument("--generate-dir", default=str(SHARED))
    ap.add_argument("--samples", type=int, default=40)
    ap.add_argument("--sources", default="hf,vllm")
    ap.add_argument("--cache-gib", type=float, default=0.05)
    ap.add_argument("--set", action="append", default=[])
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-online-"))
    try:
        gen = first_samples(Path(a.generate_dir), work / "generate", a.samples)
        base = [f"paths.runs_dir={work}", "train.epochs=2", *a.set]
        cfg = load_config(a.config, base)
        model = str(resolve_model(cfg.target.model, cfg.paths.cache_dir))
        print(
            f"{platform.node()} {platform.processor() or platform.machine()}; {a.samples} samples"
        )
        off = arm("offline", cfg, gen, model, work, None)
        for src in a.sources.split(","):
            on_cfg = load_config(
                a.config,
                [
                    *base,
                    "extract.states=online",
                    f"extract.backend={src}",
                    f"train.state_cache_gib={a.cache_gib}",
                ],
            )
            on = arm(f"online-{src}", on_cfg, gen, model, work, off["vocab"])
            la, lb = losses(off["out"]), losses(on["out"])
            worst = max(abs(x - y) / abs(x) for x, y in zip(la, lb))
            print(
                f"{on['arm']}: tokens/s {on['tokens_per_s']} vs offline {off['tokens_per_s']} "
                f"({off['tokens_per_s'] / on['tokens_per_s']:.2f}x slower); target "
                f"{on['states']['produce_s']} s, step waited {on['states']['step_wait_s']} s; "
                f"worst loss difference {worst:.1e} relative",
                flush=True,
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
