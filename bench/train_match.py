"""The fast TTT step against the eager reference on this device (bf16 autocast on CUDA).

    python bench/train_match.py --kimi --ttt 3              # H200: Kimi-K2.5 draft dims, seq 2048
    python bench/train_match.py --kimi --arch mla --ttt 3
    .venv/bin/python bench/train_match.py --seq 128          # CPU: SmolLM2 dims, float32

One batch, the same initial weights; loss and every parameter gradient of ``eager`` and ``fast``
under the train stage's autocast (on CUDA: bf16; the fast step also with autocast casting the
weights at every use, ``fast_per_use``), and of ``eager`` in float32 without autocast as the
ground truth, so the bf16 error of the fast step is seen next to the reference's own.
Gradient error: ||g - g_ref|| / ||g_ref|| per parameter, the worst parameter and the
norm-weighted overall figure.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from train import build, make_sample  # noqa: E402

from eagle3.train.batch import make_batch_fast  # noqa: E402
from eagle3.train.step import make_autocast  # noqa: E402
from eagle3.train.ttt import TTTObjective  # noqa: E402
from eagle3.train.weight_cast import set_weight_cast  # noqa: E402


def run(model, batch, ttt: int, impl: str, autocast) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    with autocast:
        loss, _ = TTTObjective(model, ttt, 0.8, impl)(batch)
    loss.backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return float(loss), grads


def compare(g: dict, ref: dict) -> dict[str, float]:
    per = {n: float((g[n] - ref[n]).norm() / ref[n].norm().clamp(min=1e-30)) for n in ref}
    num = sum(float((g[n] - ref[n]).norm()) ** 2 for n in ref) ** 0.5
    den = sum(float(ref[n].norm()) ** 2 for n in ref) ** 0.5
    worst = max(per, key=per.get)
    return {"overall": num / den, "worst": per[worst], "worst_param": worst}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kimi", action="store_true")
    ap.add_argument("--arch", choices=["llama", "mla"], default="llama")
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--ttt", type=int, default=3)
    ap.add_argument("--freeze-head", action="store_true", help="train.freeze_head")
    ap.add_argument("--json-out", type=Path, default=None)
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    seq = args.seq or (2048 if args.kimi else 512)
    cfg, model, head = build(args, dev)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    samples = [make_sample(k, seq - 37 * k, cfg.hidden_size, cfg.vocab_size, dtype) for k in (0, 1)]
    batch = make_batch_fast(samples, head, dev, seq)
    fp32 = torch.autocast(dev.type, enabled=False)
    results: dict = {"device": str(dev), "arch": args.arch, "seq": seq, "ttt": args.ttt}
    ref_batch = dataclasses.replace(batch, aux=batch.aux.float())
    loss_ref, g_ref = run(model, ref_batch, args.ttt, "eager", fp32)
    results["loss_fp32_eager"] = loss_ref
    # the stage's settings for each step (fast: one bf16 weight copy, fp32 gradient sum), and the
    # fast step with autocast casting at every use, which "once" must match up to add order
    for name, impl, cast in (
        ("eager", "eager", "auto"),
        ("fast", "fast", "auto"),
        ("fast_per_use", "fast", "per_use"),
    ):
        wc = set_weight_cast(model, cast, dev, impl, None)
        loss, g = run(model, batch, args.ttt, impl, make_autocast(dev, wc))
        results[name] = {
            "weight_cast": wc,
            "loss": loss,
            "loss_rel": abs(loss - loss_ref) / abs(loss_ref),
        }
        results[name]["grad_vs_fp32"] = compare(g, g_ref)
        results[name]["grads"] = g
    once, per_use = results["fast"]["grads"], results["fast_per_use"].pop("grads")
    results["once_vs_per_use"] = compare(once, per_use)
    results["fast_vs_eager"] = {
        "loss_rel": abs(results["fast"]["loss"] - results["eager"]["loss"])
        / abs(results["eager"]["loss"]),
        "grad": compare(results["fast"].pop("grads"), results["eager"].pop("grads")),
    }
    print(json.dumps(results, indent=1))
    if args.json_out:
        args.json_out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
