"""Train-stage throughput: the real training step (target distribution + TTT unroll + backward +
AdamW) on synthetic hidden states.

    .venv/bin/python bench/train.py                 # CPU, SmolLM2 dimensions (the embedded default)
    python bench/train.py --kimi                    # GPU, the Kimi-K2.5 draft (H 7168, 64/8 heads, I 18432,
                                                    #      V 163840, draft vocab 32000, seq 2048, TTT 7)

Prints tokens/s, peak memory and, on a GPU, MFU against the bf16 matmul rate measured in the same
run. Model FLOPs per token: 6 x trainable params x TTT steps (forward + backward of each unrolled
step) + causal attention of each step, forward and backward, + the target head (full-vocab logits
for the argmax: 2 V H, forward only).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from gpu import matmul_rate, sync  # noqa: E402
from eagle3.extract.storage import Sample  # noqa: E402
from eagle3.model import DraftConfig, Eagle3Draft  # noqa: E402
from eagle3.train import TargetHead, make_batch, make_optimizer, ttt_loss  # noqa: E402

SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
               vocab_size=49152, draft_vocab_size=8192, target_hidden_size=576, aux_layer_ids=[2, 15, 27],
               rope_theta=100000.0, rms_norm_eps=1e-5)
KIMI = dict(hidden_size=7168, intermediate_size=18432, num_attention_heads=64, num_key_value_heads=8, head_dim=112,
            vocab_size=163840, draft_vocab_size=32000, target_hidden_size=7168, aux_layer_ids=[2, 30, 58],
            rope_theta=50000.0, rms_norm_eps=1e-6, max_position_embeddings=16384)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kimi", action="store_true")
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--ttt", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dims = KIMI if args.kimi else SMOLLM2
    seq = args.seq or (2048 if args.kimi else 512)
    batch = args.batch or (1 if args.kimi else 4)
    ttt = args.ttt or (7 if args.kimi else 3)
    steps = args.steps or (10 if args.kimi else 5)
    cfg = DraftConfig(**dims)
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, {dev}"
          f"{' ' + torch.cuda.get_device_name() if dev.type == 'cuda' else ''}; torch {torch.__version__}; "
          f"{time.strftime('%Y-%m-%d %H:%M')}")
    print(f"draft: {'Kimi-K2.5' if args.kimi else 'SmolLM2-135M'} dims H {cfg.hidden_size}, heads "
          f"{cfg.num_attention_heads}/{cfg.num_key_value_heads}, I {cfg.intermediate_size}, V {cfg.vocab_size}, "
          f"D {cfg.draft_vocab_size}; batch {batch} x seq {seq}, TTT {ttt}")
    torch.manual_seed(0)
    model = Eagle3Draft(cfg).to(dev)
    h, v, d = cfg.hidden_size, cfg.vocab_size, cfg.draft_vocab_size
    head_dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    head = TargetHead(torch.ones(h), torch.randn(v, h, dtype=head_dtype) * 0.02,
                      torch.arange(0, v, v // d)[:d], torch.full((v,), -1, dtype=torch.int64), cfg.rms_norm_eps)
    head.t2draft[head.draft_ids] = torch.arange(d)
    head = head.to(dev)
    opt = make_optimizer(model, 1e-4, 0.0)
    state_dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    samples = [Sample(f"s{i}", torch.randint(0, v, (seq,)), torch.ones(seq, dtype=torch.bool),
                      torch.randn(seq, 3 * h, dtype=state_dtype), torch.randn(seq, h, dtype=state_dtype) * 3)
               for i in range(batch)]
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else torch.autocast("cpu", enabled=False)

    def step() -> float:
        b = make_batch(samples, head, dev, seq)
        with autocast:
            loss, _ = ttt_loss(model, b, ttt, 0.8)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    step()  # warm-up
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync(dev)
    dt = (time.perf_counter() - t0) / steps
    tokens = batch * seq
    tok_s = tokens / dt
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    attn = 0
    for i in range(ttt):  # step i: T queries over T (causal, ~T/2) + i diagonal keys; QK^T and PV, fwd + bwd
        attn += 3 * 2 * 2 * (seq / 2 + i) * cfg.num_attention_heads * cfg.head_dim
    flops_per_token = 6 * trainable * ttt + attn + 2 * v * h
    peak = (torch.cuda.max_memory_allocated() if dev.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    print(f"trainable params {trainable / 1e6:.1f} M (+ frozen embedding {v * h / 1e6:.0f} M)")
    print(f"step {dt * 1000:.0f} ms -> {tok_s:.0f} tokens/s; peak memory {peak / 2**30:.1f} GiB "
          f"({'GPU allocated' if dev.type == 'cuda' else 'process RSS'}); {flops_per_token / 1e9:.2f} GFLOP/token")
    result = {"tokens_per_s": tok_s, "step_s": dt, "peak_gib": peak / 2**30, "gflop_per_token": flops_per_token / 1e9}
    if dev.type == "cuda":
        rate = matmul_rate(dev)
        mfu = tok_s * flops_per_token / rate
        print(f"bf16 matmul measured {rate / 1e12:.0f} TFLOP/s -> MFU {mfu:.1%} (goal >= 45%)")
        result |= {"matmul_tflops": rate / 1e12, "mfu": mfu}
    if args.kimi:
        seed = 10 * 1000 * seq / (27.7 * 60)
        print(f"seed run: 10 epochs x 1000 samples in 27.7 min on one GPU = {seed:.0f} tokens/s if samples average "
              f"{seq} tokens (assumption: the seed's length distribution is not recorded) -> this run is "
              f"{tok_s / seed:.2f}x that")
        result["seed_tokens_per_s_at_seq"] = seed
    print(json.dumps(result))


if __name__ == "__main__":
    main()
