"""Train-stage throughput: the real training step (target distribution + TTT unroll + backward +
AdamW) on synthetic hidden states.

    .venv/bin/python bench/train.py                 # CPU, SmolLM2 dimensions (the embedded default)
    python bench/train.py --kimi                    # GPU, the Kimi-K2.5 draft (H 7168, 64/8 heads, I 18432,
                                                    #      V 163840, draft vocab 32000, seq 2048, TTT 7)
    torchrun --nproc-per-node 2 bench/train.py --kimi --ddp    # (or --fsdp) N GPUs, one global batch of
                                                    #      N x accum x batch samples per step
    python bench/train.py --kimi --accum 2          # the one-GPU reference of that global batch

Prints tokens/s, peak memory and, on a GPU, MFU against the bf16 matmul rate measured in the same
run. Model FLOPs per token: 6 x trainable params x TTT steps (forward + backward of each unrolled
step) + causal attention of each step, forward and backward, + the target head (full-vocab logits
for the argmax: 2 V H, forward only).

The step is eagle3.train.train_step, the one the train stage runs (all-reduced loss denominators,
DDP or FSDP as train.py wraps them, the frozen embedding in bf16 on GPU). Under torchrun (--ddp /
--fsdp), or with --accum, it also prints per-rank tokens/s and peak memory, the aggregate, and the
loss of every step: sample i of the global batch is drawn from its own seed, so a run on N ranks
and one process with --accum N (same --batch, --seq, --steps) train on the same global batches
from the same initial weights and their losses should agree (bf16: to about 1e-3 relative). Give
--single-tokens-per-s (the one-GPU run's tokens/s at the same --batch) for the scaling efficiency.
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
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from gpu import matmul_rate, sync  # noqa: E402

from eagle3.draft import DraftConfig, Eagle3Draft  # noqa: E402
from eagle3.extract.storage import Sample  # noqa: E402
from eagle3.train import (
    TargetHead,
    hold_frozen_bf16,
    init_distributed,
    make_batch,
    make_optimizer,  # noqa: E402
    train_step,
    wrap_for_training,
)

SMOLLM2 = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    vocab_size=49152,
    draft_vocab_size=8192,
    target_hidden_size=576,
    aux_layer_ids=[2, 15, 27],
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
)
KIMI = dict(
    hidden_size=7168,
    intermediate_size=18432,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=112,
    vocab_size=163840,
    draft_vocab_size=32000,
    target_hidden_size=7168,
    aux_layer_ids=[2, 30, 58],
    rope_theta=50000.0,
    rms_norm_eps=1e-6,
    max_position_embeddings=16384,
)


# A small DeepSeek-style geometry at SmolLM2's width, for the CPU run of --arch mla.
TINY_MLA = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_attention_heads=9,
    q_lora_rank=256,
    kv_lora_rank=512,
    qk_nope_head_dim=64,
    qk_rope_head_dim=64,
    v_head_dim=64,
    vocab_size=49152,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    max_position_embeddings=8192,
)


def make_sample(i: int, seq: int, h: int, v: int, dtype: torch.dtype) -> Sample:
    """Global sample i, the same on whichever rank draws it."""
    g = torch.Generator().manual_seed(1000 + i)
    return Sample(
        f"s{i}",
        torch.randint(0, v, (seq,), generator=g),
        torch.ones(seq, dtype=torch.bool),
        torch.randn(seq, 3 * h, generator=g).to(dtype),
        (torch.randn(seq, h, generator=g) * 3).to(dtype),
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kimi", action="store_true")
    ap.add_argument(
        "--arch",
        choices=["llama", "mla"],
        default="llama",
        help="mla: the DeepSeek-style draft (with --kimi: from configs/targets/moonshotai--Kimi-K2.5.json)",
    )
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--batch", type=int, default=None, help="samples per micro-batch (per rank)")
    ap.add_argument("--ttt", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--ddp", action="store_true", help="under torchrun: DDP")
    ap.add_argument("--fsdp", action="store_true", help="under torchrun: FSDP (fully_shard)")
    ap.add_argument(
        "--accum", type=int, default=None, help="micro-batches per rank per step (default 1)"
    )
    ap.add_argument(
        "--single-tokens-per-s",
        type=float,
        default=None,
        help="the one-GPU tokens/s at the same --batch, for the scaling efficiency",
    )
    args = ap.parse_args()
    if args.ddp and args.fsdp:
        ap.error("--ddp or --fsdp, not both")
    multi = args.ddp or args.fsdp or args.accum is not None  # print the per-rank / per-step report
    if "TORCHELASTIC_RUN_ID" in os.environ and not (args.ddp or args.fsdp):
        ap.error("under torchrun pass --ddp or --fsdp")
    dist_info, dev = init_distributed("fsdp" if args.fsdp else "ddp")
    rank, world = dist_info.rank, dist_info.world
    accum = args.accum or 1
    dims = KIMI if args.kimi else SMOLLM2
    seq = args.seq or (2048 if args.kimi else 512)
    batch = args.batch or (1 if args.kimi else 4)
    ttt = args.ttt or (7 if args.kimi else 3)
    steps = args.steps or (10 if args.kimi else 5)
    if args.arch == "mla":
        from eagle3.draft import Eagle3MLADraft, MLADraftConfig

        if args.kimi:
            cfg = MLADraftConfig.from_target(
                ROOT / "configs/targets/moonshotai--Kimi-K2.5.json", 32000, [2, 30, 58]
            )
        else:
            cfg = MLADraftConfig.from_target(dict(TINY_MLA), 8192, [2, 15, 27])
    else:
        cfg = DraftConfig(**dims)
    say = print if rank == 0 else (lambda *a, **k: None)
    say(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, {dev}"
        f"{' ' + torch.cuda.get_device_name() if dev.type == 'cuda' else ''}; torch {torch.__version__}; "
        f"{time.strftime('%Y-%m-%d %H:%M')}"
    )
    heads = (
        f"MLA {cfg.num_attention_heads} heads, q/kv rank {cfg.q_lora_rank}/{cfg.kv_lora_rank}"
        if args.arch == "mla"
        else f"heads {cfg.num_attention_heads}/{cfg.num_key_value_heads}"
    )
    say(
        f"draft ({args.arch}): {'Kimi-K2.5' if args.kimi else 'SmolLM2-135M'} dims H {cfg.hidden_size}, {heads}, "
        f"I {cfg.intermediate_size}, V {cfg.vocab_size}, D {cfg.draft_vocab_size}; batch {batch} x seq {seq}, TTT {ttt}"
    )
    if multi:
        say(
            f"distributed: {dist_info.mode} on {world} rank(s), {accum} micro-batch(es) per rank per step: global "
            f"batch {world * accum * batch} samples = {world * accum * batch * seq} tokens per step"
        )
    torch.manual_seed(0)
    model = (Eagle3MLADraft(cfg) if args.arch == "mla" else Eagle3Draft(cfg)).to(dev)
    hold_frozen_bf16(model, dev)
    h, v, d = cfg.hidden_size, cfg.vocab_size, cfg.draft_vocab_size
    head_dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    head = TargetHead(
        torch.ones(h),
        torch.randn(v, h, dtype=head_dtype) * 0.02,
        torch.arange(0, v, v // d)[:d],
        torch.full((v,), -1, dtype=torch.int64),
        cfg.rms_norm_eps,
    )
    head.t2draft[head.draft_ids] = torch.arange(d)
    head = head.to(dev)
    net = wrap_for_training(model, dist_info, dev, ttt, 0.8)
    opt = make_optimizer(model, 1e-4, 0.0)
    params = [p for p in model.parameters() if p.requires_grad]
    state_dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    # rank r's micro-batch j is global batch r + j * world (as train.py deals them out)
    micro_samples = [
        [make_sample((rank + j * world) * batch + k, seq, h, v, state_dtype) for k in range(batch)]
        for j in range(accum)
    ]
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16)
        if dev.type == "cuda"
        else torch.autocast("cpu", enabled=False)
    )
    losses: list[float] = []

    def step() -> float:
        micro = [make_batch(s, head, dev, seq) for s in micro_samples]
        r = train_step(net, opt, params, micro, dist_info, ttt, 0.8, 0.5, autocast)
        losses.append(r.loss)
        return r.loss

    step()  # warm-up
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    sync(dev)
    if world > 1:
        dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync(dev)
    dt = (time.perf_counter() - t0) / steps
    tokens = batch * seq * accum  # this rank's, per step
    tok_s = tokens / dt
    trainable = sum(p.numel() for p in params)  # FSDP: DTensor numel is the whole tensor's
    attn = 0
    for i in range(
        ttt
    ):  # step i: T queries over T (causal, ~T/2) + i diagonal keys; QK^T and PV, fwd + bwd
        qk_v = (
            cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim
            if args.arch == "mla"
            else 2 * cfg.head_dim
        )  # QK^T width + PV width per head
        attn += 3 * 2 * (seq / 2 + i) * cfg.num_attention_heads * qk_v
    flops_per_token = 6 * trainable * ttt + attn + 2 * v * h
    peak = (
        torch.cuda.max_memory_allocated()
        if dev.type == "cuda"
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    )
    reserved = torch.cuda.max_memory_reserved() if dev.type == "cuda" else peak
    ranks = [
        {
            "rank": rank,
            "step_s": dt,
            "tokens_per_s": tok_s,
            "peak_gib": peak / 2**30,
            "reserved_gib": reserved / 2**30,
        }
    ]
    if world > 1:
        gathered: list = [None] * world
        dist.all_gather_object(gathered, ranks[0])
        ranks = gathered
    if world > 1:  # the global step is as slow as the slowest rank (they meet in the all-reduce)
        dt = max(r["step_s"] for r in ranks)
        tok_s = tokens / dt  # per rank (per GPU)
        peak = max(r["peak_gib"] for r in ranks) * 2**30
    say(f"trainable params {trainable / 1e6:.1f} M (+ frozen embedding {v * h / 1e6:.0f} M)")
    say(
        f"step {dt * 1000:.0f} ms -> {tok_s:.0f} tokens/s{' per rank' if world > 1 else ''}; peak memory "
        f"{peak / 2**30:.1f} GiB ({'GPU allocated' if dev.type == 'cuda' else 'process RSS'}"
        f"{', max over ranks' if world > 1 else ''}); {flops_per_token / 1e9:.2f} GFLOP/token"
    )
    result = {
        "tokens_per_s": tok_s,
        "step_s": dt,
        "peak_gib": peak / 2**30,
        "gflop_per_token": flops_per_token / 1e9,
    }
    if multi:
        for r in ranks:
            mem = (
                f"{r['peak_gib']:.1f} GiB allocated / {r['reserved_gib']:.1f} GiB reserved"
                if dev.type == "cuda"
                else f"{r['peak_gib']:.1f} GiB RSS"
            )
            say(
                f"  rank {r['rank']}: step {r['step_s'] * 1000:.0f} ms, {r['tokens_per_s']:.0f} tokens/s, peak {mem}"
            )
        total = world * tokens / dt
        say(f"aggregate: {total:.0f} tokens/s over {world} rank(s) ({total / world:.0f} per rank)")
        say("loss per step (warm-up first): " + " ".join(f"{x:.6f}" for x in losses))
        result |= {
            "mode": dist_info.mode,
            "world_size": world,
            "accum": accum,
            "aggregate_tokens_per_s": total,
            "ranks": ranks,
            "losses": losses,
        }
        if args.single_tokens_per_s:
            eff = total / world / args.single_tokens_per_s
            say(
                f"scaling efficiency vs one GPU ({args.single_tokens_per_s:.0f} tokens/s): {eff:.1%}"
            )
            result["scaling_efficiency"] = eff
    if dev.type == "cuda" and rank == 0:
        rate = matmul_rate(dev)
        mfu = tok_s * flops_per_token / rate
        say(
            f"bf16 matmul measured {rate / 1e12:.0f} TFLOP/s -> MFU {mfu:.1%} (goal >= 45%)"
            f"{' per GPU' if world > 1 else ''}"
        )
        result |= {"matmul_tflops": rate / 1e12, "mfu": mfu}
    if args.kimi and rank == 0:
        seed = 10 * 1000 * seq / (27.7 * 60)
        print(
            f"seed run: 10 epochs x 1000 samples in 27.7 min on one GPU = {seed:.0f} tokens/s if samples average "
            f"{seq} tokens (assumption: the seed's length distribution is not recorded) -> this run is "
            f"{tok_s / seed:.2f}x that"
        )
        result["seed_tokens_per_s_at_seq"] = seed
    say(json.dumps(result))
    if dist_info.owns_group:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
