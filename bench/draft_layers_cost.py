"""What a draft layer costs a step on vLLM CPU (issue 40, ``train.draft_num_layers``).

Random-weight Llama drafts for SmolLM2 with 1, 2 and 4 decoder layers, each exported once (with
parallel-drafting fields) and served at k = 3 twice, with ``parallel_drafting`` (one draft pass
a step) and sequentially (k passes), after the target alone. Their acceptance is ~0, so every
step emits one token and a step's time is 1 / tokens/s: the difference to the target alone is
what the draft costs a step, and its growth with the layers is one layer's cost per pass. One
server at a time, the verify stage's own client and counters (eagle3/verify/arms.py).

    .venv/bin/python bench/draft_layers_cost.py [-c configs/smollm2-cpu.yaml] [--prompts 10]
        [--layers 1 2 4] [--k 3] [--out OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def export_random_draft(cfg, model_dir: Path, layers: int, k: int, out: Path) -> Path:
    import torch

    from eagle3.draft import build_draft
    from eagle3.draft.export import export_vllm
    from eagle3.vocab import build_vocab

    torch.manual_seed(0)
    d = cfg.vocab.draft_vocab_size
    draft = build_draft(model_dir, d, list(cfg.aux_layers), num_layers=layers, parallel_depths=k)
    counts = torch.arange(draft.config.vocab_size, dtype=torch.int64) + 1
    vocab = build_vocab(counts, d)
    return export_vllm(draft, None, vocab.d2t, vocab.t2d, out)


def serve_and_measure(cfg, model: str, spec: dict | None, convs, log_dir: Path) -> dict:
    from eagle3.serving.server import start_server
    from eagle3.verify.arms import measure, per_position, tokens_per_s

    with start_server(cfg, model, speculative_config=spec, log_dir=log_dir) as srv:
        windows = measure(srv, convs, cfg, log_dir.name)
    tps = tokens_per_s(windows)[1]
    acc = sum(per_position(windows).values()) if spec else 0.0
    return {"tokens_per_s": round(tps, 2), "acceptance_length": round(1 + acc, 3),
            "step_ms": round(1000 * (1 + acc) / tps, 1)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-c", "--config", default=str(ROOT / "configs" / "smollm2-cpu.yaml"))
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--layers", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("/tmp/draft-layers-cost"))
    a = ap.parse_args()

    from eagle3.config import load_config
    from eagle3.embedded import resolve_model
    from eagle3.serving.units import speculative_config
    from eagle3.target_checkpoint import checkpoint_dir
    from eagle3.verify.workload import load_workload

    over = ["serve.port=0", "verify.concurrency=[1]", "verify.warmup_requests=1"]
    cfg = load_config(a.config, over)
    model = resolve_model(cfg.target.model, cfg.paths.cache_dir)
    convs = load_workload(cfg.verify.workload, a.prompts, 1)
    a.out.mkdir(parents=True, exist_ok=True)
    rows = [{"arm": "target alone", **serve_and_measure(cfg, model, None, convs, a.out / "base")}]
    print(json.dumps(rows[-1]), flush=True)
    for n in a.layers:
        draft = export_random_draft(cfg, checkpoint_dir(model), n, a.k, a.out / f"draft-l{n}")
        for parallel in (True, False):
            spec = speculative_config(cfg, str(draft), a.k, parallel)
            name = f"{n} layer(s), {'parallel' if parallel else 'sequential'} k={a.k}"
            t0 = time.time()
            r = serve_and_measure(cfg, model, spec, convs, a.out / f"l{n}-{int(parallel)}")
            rows.append({"arm": name, **r, "wall_s": round(time.time() - t0, 1)})
            print(json.dumps(rows[-1]), flush=True)
    base = rows[0]["step_ms"]
    print(f"\n{'arm':34} {'tok/s':>7} {'AL':>6} {'step ms':>8} {'+ms vs target':>14}")
    for r in rows:
        extra = r["step_ms"] - base
        print(f"{r['arm']:34} {r['tokens_per_s']:7.2f} {r['acceptance_length']:6.3f} "
              f"{r['step_ms']:8.1f} {extra:14.1f}")  # fmt: skip
    (a.out / "rows.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
