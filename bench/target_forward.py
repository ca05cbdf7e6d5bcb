"""The target's forward as extract and online training run it (``forward_states``): right-padded,
length-bucketed batches under ``extract.token_budget``, with the padding mask vs causal alone.

    .venv/bin/python bench/target_forward.py                         # CPU: the embedded SmolLM2
    python bench/target_forward.py --gen GENERATE_DIR --samples 3000  # GPU: real lengths, 64K budget

Why both: with a mask, transformers builds a 4D attention mask and SDPA runs a masked kernel; with
right padding and causal attention the real rows never see the pads, so the mask changes nothing
but SDPA's path (masked with it, causal without). Prints tokens/s of each arm (alternating,
``--repeats`` times, best kept), their ratio and the largest relative difference of the first
forward's states.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from gpu import sync  # noqa: E402

from eagle3.batching import token_budget_batches  # noqa: E402
from eagle3.config import load_config  # noqa: E402
from eagle3.embedded import resolve_model  # noqa: E402
from eagle3.extract.hf_backend import (  # noqa: E402
    LayerTap,
    forward_states,
    load_base_model,
    pick_device,
    pick_dtype,
)
from eagle3.generate.storage import iter_samples  # noqa: E402


def sequences(gen: str | None, n: int, max_len: int, vocab: int) -> list[list[int]]:
    """``n`` conversations of a generate folder (prompt + answer ids, cut at ``max_len``), or
    random ids of ShareGPT-like lengths (64..``max_len``) when there is none."""
    if gen:
        out = []
        for s in iter_samples(Path(gen)):
            out.append((s["prompt_token_ids"] + s["completion_token_ids"])[:max_len])
            if len(out) == n:
                break
        return out
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(64, max_len + 1, (n,), generator=g).tolist()
    return [torch.randint(0, vocab, (t,), generator=g).tolist() for t in lens]


def run(model, tap, batches, seqs, device, masked: bool) -> tuple[float, list]:
    sync(device)
    t0 = time.perf_counter()
    first = None
    for b in batches:
        out = forward_states(model, tap, [seqs[i] for i in b], device, to_host=False, masked=masked)
        first = first or out
    sync(device)
    return sum(len(s) for s in seqs) / (time.perf_counter() - t0), first


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/smollm2-sharegpt.yaml")
    ap.add_argument("--gen", default=None, help="a generate folder (default: random ids)")
    ap.add_argument("--samples", type=int, default=None, help="default: 3000 on CUDA, 48 on CPU")
    ap.add_argument("--token-budget", type=int, default=None, help="default: the profile's")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    cfg = load_config(a.config)
    dev = pick_device()
    n = a.samples or (3000 if dev.type == "cuda" else 48)
    budget = a.token_budget or (cfg.extract.token_budget if dev.type == "cuda" else 4096)
    path = resolve_model(cfg.target.model, cfg.paths.cache_dir)
    model = load_base_model(str(path), dev, pick_dtype(cfg.extract.dtype, dev))
    tap = LayerTap(model, list(cfg.aux_layers))
    seqs = sequences(a.gen, n, cfg.extract.max_seq_len, model.config.vocab_size)
    batches = token_budget_batches([len(s) for s in seqs], budget)
    best = {"masked": 0.0, "causal": 0.0}
    states = {}
    for _ in range(a.repeats):
        for arm in best:
            rate, first = run(model, tap, batches, seqs, dev, arm == "masked")
            best[arm] = max(best[arm], rate)
            states[arm] = first
    worst = 0.0
    for (a1, f1), (a2, f2) in zip(states["masked"], states["causal"]):
        for x, y in ((a1, a2), (f1, f2)):
            worst = max(worst, ((x.float() - y.float()).norm() / y.float().norm()).item())
    name = torch.cuda.get_device_name() if dev.type == "cuda" else platform.processor() or "cpu"
    print(
        json.dumps(
            {
                "device": name,
                "dtype": str(next(model.parameters()).dtype),
                "samples": len(seqs),
                "tokens": sum(len(s) for s in seqs),
                "forwards": len(batches),
                "token_budget": budget,
                "masked_tok_s": round(best["masked"]),
                "causal_tok_s": round(best["causal"]),
                "causal_over_masked": round(best["causal"] / best["masked"], 3),
                "max_rel_diff": float(f"{worst:.2e}"),
            }
        )
    )


if __name__ == "__main__":
    main()
