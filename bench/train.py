"""Train-stage throughput: the real training step (target distribution + TTT unroll + backward +
AdamW) on synthetic hidden states.

    .venv/bin/python bench/train.py          # CPU, SmolLM2 dimensions (the embedded default)
    python bench/train.py --kimi             # GPU, the Kimi-K2.5 draft (H 7168, 64/8 heads,
                                             #   I 18432, V 163840, D 32000, seq 2048, TTT 7)
    torchrun --nproc-per-node 2 bench/train.py --kimi --ddp   # (or --fsdp) N GPUs, one global
                                             #   batch of N x accum x batch samples per step
    python bench/train.py --kimi --accum 2   # the one-GPU reference of that global batch
    python bench/train.py --kimi --impl eager   # the reference step (train.step_impl: eager)
    python bench/train.py --kimi --profile   # + torch.profiler's top kernels of 2 steps

Prints tokens/s, peak memory, the time per phase (batch: the padded batch and the target
distribution; forward; backward; optimizer: clip + AdamW; from CUDA events, wall time on CPU)
and, on a GPU, MFU against the bf16 matmul rate measured in the same run. Model FLOPs per token:
eagle3/train/flops.py (fc 4N once; the layer 6N and a trainable lm_head 6DH per TTT step; only
the causal + diagonal attention pairs; the target head 2VH forward, once per token).
The step is the train stage's, with the settings it picks on this device (train.step_impl auto,
fused AdamW and bf16 autocast without the weight-cast cache on CUDA, one step in flight).

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

from gpu import Phases, matmul_rate, profile_table, sync  # noqa: E402

from eagle3.draft import DraftConfig, Eagle3Draft  # noqa: E402
from eagle3.extract.storage import Sample  # noqa: E402
from eagle3.train import (  # noqa: E402
    TargetHead,
    hold_frozen_bf16,
    init_distributed,
    make_batch,
    make_optimizer,
    wrap_for_training,
)
from eagle3.train.flops import flops_per_token, layer_params  # noqa: E402
from eagle3.train.loader import Loader, prefetch_on  # noqa: E402
from eagle3.train.step import (  # noqa: E402
    make_autocast,
    resolve_step_impl,
    train_step_async,
)
from eagle3.train.step_fast import PendingStep  # noqa: E402
from eagle3.train.target import target_argmax  # noqa: E402
from eagle3.train.weight_cast import fp32_output_gemm, set_weight_cast  # noqa: E402

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


def build(args: argparse.Namespace, dev: torch.device) -> tuple:
    """(draft config, draft on ``dev``, target head) of the chosen dims; built on the device
    (a Kimi-size draft initialised on the host takes longer than the benchmark)."""
    if args.arch == "mla":
        from eagle3.draft import Eagle3MLADraft, MLADraftConfig

        if args.kimi:
            cfg = MLADraftConfig.from_target(
                ROOT / "configs/targets/moonshotai--Kimi-K2.5.json", 32000, [2, 30, 58]
            )
        else:
            cfg = MLADraftConfig.from_target(dict(TINY_MLA), 8192, [2, 15, 27])
        cls = Eagle3MLADraft
    else:
        cfg = DraftConfig(**(KIMI if args.kimi else SMOLLM2))
        cls = Eagle3Draft
    torch.manual_seed(0)
    with torch.device(dev):
        model = cls(cfg)
    if args.freeze_head:  # as the train stage does with train.freeze_head
        for p in (*model.lm_head.parameters(), *model.norm.parameters()):
            p.requires_grad_(False)
    hold_frozen_bf16(model, dev)
    h, v, d = cfg.hidden_size, cfg.vocab_size, cfg.draft_vocab_size
    head_dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    head = TargetHead(
        torch.ones(h, device=dev),
        torch.randn(v, h, dtype=head_dtype, device=dev) * 0.02,
        torch.arange(0, v, v // d, device=dev)[:d],
        torch.full((v,), -1, dtype=torch.int64, device=dev),
        cfg.rms_norm_eps,
    )
    head.t2draft[head.draft_ids] = torch.arange(d, device=dev)
    return cfg, model, head


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kimi", action="store_true")
    ap.add_argument(
        "--arch",
        choices=["llama", "mla"],
        default="llama",
        help="mla: the DeepSeek-style draft (--kimi: configs/targets/moonshotai--Kimi-K2.5.json)",
    )
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--batch", type=int, default=None, help="samples per micro-batch (per rank)")
    ap.add_argument("--ttt", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument(
        "--impl", choices=["auto", "eager", "fast"], default="auto", help="train.step_impl"
    )
    ap.add_argument("--profile", action="store_true", help="torch.profiler top kernels")
    ap.add_argument(
        "--sdpa", choices=["no_cudnn", "auto"], default="no_cudnn", help="train.sdpa (CUDA)"
    )
    ap.add_argument(
        "--vary-lengths",
        action="store_true",
        help="a new padded length every step (seq, seq - 8, ...), as the train stage's padded "
        "batches have: what per-shape set-up costs (tokens/s over the mean length)",
    )
    ap.add_argument(
        "--optimizer", choices=["adamw", "muon"], default="adamw", help="train.optimizer"
    )
    ap.add_argument(
        "--freeze-head",
        action="store_true",
        help="train.freeze_head: lm_head and the final norm fixed (held in bf16 on CUDA)",
    )
    ap.add_argument(
        "--compile", action="store_true", help="torch.compile the norms, SiLU x up and loss math"
    )
    ap.add_argument(
        "--sync-debug",
        action="store_true",
        help="CUDA: warn at every host sync during the measured steps (torch's sync debug mode)",
    )
    ap.add_argument(
        "--weight-cast",
        choices=["auto", "once", "per_use", "cache"],
        default="auto",
        help="train.weight_cast (CUDA): once = one bf16 weight copy per forward, fp32 sum of "
        "the TTT steps' weight gradients (auto for the fast step); per_use = autocast casting at "
        "every use; cache = autocast's cache (bf16 sum)",
    )
    ap.add_argument(
        "--prefetch",
        choices=["auto", "on", "off"],
        default="auto",
        help="train.prefetch: pad the next step's batch on a thread (auto: on CUDA)",
    )
    ap.add_argument("--json-out", type=Path, default=None, help="also write the result here")
    ap.add_argument("--ddp", action="store_true", help="under torchrun: DDP")
    ap.add_argument("--fsdp", action="store_true", help="under torchrun: FSDP (fully_shard)")
    ap.add_argument("--accum", type=int, default=None, help="micro-batches per rank per step")
    ap.add_argument(
        "--single-tokens-per-s",
        type=float,
        default=None,
        help="the one-GPU tokens/s at the same --batch, for the scaling efficiency",
    )
    args = ap.parse_args()
    if args.ddp and args.fsdp:
        ap.error("--ddp or --fsdp, not both")
    if "TORCHELASTIC_RUN_ID" in os.environ and not (args.ddp or args.fsdp):
        ap.error("under torchrun pass --ddp or --fsdp")
    return args


def main() -> None:
    args = parse()
    multi = args.ddp or args.fsdp or args.accum is not None  # the per-rank / per-step report
    dist_info, dev = init_distributed("fsdp" if args.fsdp else "ddp")
    rank, world = dist_info.rank, dist_info.world
    accum = args.accum or 1
    seq = args.seq or (2048 if args.kimi else 512)
    batch = args.batch or (1 if args.kimi else 4)
    ttt = args.ttt or (7 if args.kimi else 3)
    steps = args.steps or (10 if args.kimi else 5)
    impl = resolve_step_impl(args.impl)
    cfg, model, head = build(args, dev)
    say = print if rank == 0 else (lambda *a, **k: None)
    gpu = f" {torch.cuda.get_device_name()}" if dev.type == "cuda" else ""
    say(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, {dev}{gpu}; torch "
        f"{torch.__version__}; {time.strftime('%Y-%m-%d %H:%M')}"
    )
    heads = (
        f"MLA {cfg.num_attention_heads} heads, q/kv rank {cfg.q_lora_rank}/{cfg.kv_lora_rank}"
        if args.arch == "mla"
        else f"heads {cfg.num_attention_heads}/{cfg.num_key_value_heads}"
    )
    say(
        f"draft ({args.arch}): {'Kimi-K2.5' if args.kimi else 'SmolLM2-135M'} dims H "
        f"{cfg.hidden_size}, {heads}, I {cfg.intermediate_size}, V {cfg.vocab_size}, D "
        f"{cfg.draft_vocab_size}; batch {batch} x seq {seq}, TTT {ttt}; step {impl}; "
        f"{args.optimizer}{', frozen head' if args.freeze_head else ''}"
    )
    if multi:
        say(
            f"distributed: {dist_info.mode} on {world} rank(s), {accum} micro-batch(es) per rank "
            f"per step: global batch {world * accum * batch} samples = "
            f"{world * accum * batch * seq} tokens per step"
        )
    if args.compile:
        from eagle3.train.compiled import compile_step

        compile_step(model)
    net = wrap_for_training(model, dist_info, dev, ttt, 0.8, impl)
    fused = impl == "fast" and dev.type == "cuda" and not args.fsdp  # as the train stage
    opt = make_optimizer(model, 1e-4, 0.0, fused=fused, kind=args.optimizer)
    params = [p for p in model.parameters() if p.requires_grad]
    state_dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    h, v = cfg.hidden_size, cfg.vocab_size
    # rank r's micro-batch j is global batch r + j * world (as train.py deals them out)
    micro_samples = [
        [make_sample((rank + j * world) * batch + k, seq, h, v, state_dtype) for k in range(batch)]
        for j in range(accum)
    ]
    weight_cast = set_weight_cast(model, args.weight_cast, dev, impl, dist_info.mode)
    say(f"weight cast: {weight_cast}; compiled: {args.compile}")
    autocast = make_autocast(dev, weight_cast, args.sdpa)
    # the fast step's batches as the train stage builds them from the shards: the loader (argmax
    # once per sample, then the draft rows; the next step padded on a thread where it picks it)
    prefetch = prefetch_on(args.prefetch, dev)
    flat = [s for ss in micro_samples for s in ss]
    groups = [list(range(j * batch, (j + 1) * batch)) for j in range(accum)]
    loader = Loader(flat.__getitem__, head, dev, seq, prefetch=prefetch)
    phases = Phases(dev)
    losses: list[float] = []
    pending: list = []

    def settle() -> None:  # the train loop's one step in flight (eagle3.train.progress)
        while pending:
            r = pending.pop(0)
            losses.append((r.resolve() if isinstance(r, PendingStep) else r).loss)

    used: list[int] = []  # padded length of each step (--vary-lengths: a new one every step)

    def step() -> None:
        phases.start()
        n = seq - 8 * (len(used) % max(1, seq // 16)) if args.vary_lengths else seq
        used.append(n)
        if impl == "fast":
            loader.max_seq_len = n
            micro = [loader.batch(idx) for idx in groups]
            loader.prefetch(groups)  # the next step's (the same samples here)
        else:
            micro = [make_batch(s, head, dev, n) for s in micro_samples]
        phases.mark("batch")
        r = train_step_async(net, opt, params, micro, dist_info, 0.5, autocast, phases.mark)
        settle()
        pending.append(r)

    for _ in range(2):  # warm-up
        step()
    settle()
    sync(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    if world > 1:
        dist.barrier()
    phases.on = True
    if args.sync_debug and dev.type == "cuda":
        torch.cuda.set_sync_debug_mode("warn")
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    settle()
    sync(dev)
    dt = (time.perf_counter() - t0) / steps
    if args.vary_lengths:  # tokens and FLOPs at the measured steps' mean padded length
        seq = round(sum(used[-steps:]) / steps)
    phases.on = False
    if args.sync_debug and dev.type == "cuda":
        torch.cuda.set_sync_debug_mode("default")
    argmax_ms = argmax_once_ms(flat[:batch], head, dev)
    report(args, locals_for_report(locals()))
    if args.profile and rank == 0:
        print(profile_table(step, dev))
        settle()
    loader.close()
    if dist_info.owns_group:
        dist.barrier()
        dist.destroy_process_group()


def argmax_once_ms(samples: list, head: TargetHead, dev: torch.device) -> float:
    """Time of the target's full-vocab argmax over one micro-batch's states: what the loader
    adds to a sample's first batch (its first epoch), not to the measured steps."""
    final = torch.cat([s.final for s in samples]).to(dev)
    target_argmax(final, head)
    sync(dev)
    t0 = time.perf_counter()
    target_argmax(final, head)
    sync(dev)
    return (time.perf_counter() - t0) * 1000


def locals_for_report(scope: dict) -> dict:
    keys = "cfg model params dev dt batch seq accum ttt steps rank world dist_info phases losses"
    more = {k: scope[k] for k in ("impl", "multi", "argmax_ms", "weight_cast")}
    return {k: scope[k] for k in keys.split()} | more


def report(args: argparse.Namespace, r: dict) -> None:
    """Print (rank 0) tokens/s, memory, FLOPs/token by term, phases, MFU; the JSON result."""
    dev, dt, world, rank = r["dev"], r["dt"], r["world"], r["rank"]
    say = print if rank == 0 else (lambda *a, **k: None)
    cfg = r["cfg"]
    tokens = r["batch"] * r["seq"] * r["accum"]  # this rank's, per step
    tok_s = tokens / dt
    trainable = sum(p.numel() for p in r["params"])  # FSDP: DTensor numel is the whole tensor's
    flops = flops_per_token(
        cfg, layer_params(r["model"]), r["seq"], r["ttt"], not args.freeze_head, r["impl"] == "fast"
    )
    cuda = dev.type == "cuda"
    peak = (
        torch.cuda.max_memory_allocated()
        if cuda
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    )
    reserved = torch.cuda.max_memory_reserved() if cuda else peak
    ranks = [
        {
            "rank": rank,
            "step_s": dt,
            "tokens_per_s": tok_s,
            "peak_gib": peak / 2**30,
            "reserved_gib": reserved / 2**30,
        }
    ]
    if world > 1:  # the global step is as slow as the slowest rank (they meet in the all-reduce)
        gathered: list = [None] * world
        dist.all_gather_object(gathered, ranks[0])
        ranks = gathered
        dt = max(x["step_s"] for x in ranks)
        tok_s = tokens / dt  # per rank (per GPU)
        peak = max(x["peak_gib"] for x in ranks) * 2**30
    v, h = cfg.vocab_size, cfg.hidden_size
    say(f"trainable params {trainable / 1e6:.1f} M (+ frozen embedding {v * h / 1e6:.0f} M)")
    say(
        f"step {dt * 1000:.1f} ms -> {tok_s:.0f} tokens/s{' per rank' if world > 1 else ''}; "
        f"peak memory {peak / 2**30:.1f} GiB ({'GPU allocated' if cuda else 'process RSS'}"
        f"{', max over ranks' if world > 1 else ''})"
    )
    say(
        f"{flops['total'] / 1e9:.2f} GFLOP/token: "
        + ", ".join(f"{k} {x / 1e9:.3f}" for k, x in flops.items() if k != "total")
    )
    ph = r["phases"].totals(r["steps"])
    say(
        f"phases per step ({'CUDA events' if cuda else 'wall'}): "
        + ", ".join(f"{k} {x * 1000:.1f} ms" for k, x in ph.items())
    )
    if r["impl"] == "fast":
        say(
            f"not in the steps: the target's full-vocab argmax, once per sample (its first "
            f"batch): {r['argmax_ms']:.1f} ms per micro-batch"
        )
    result = {
        "impl": r["impl"],
        "weight_cast": r["weight_cast"],
        "fp32_output_gemm": fp32_output_gemm(),  # once: the steps' weight-gradient GEMM
        "compile": args.compile,
        "arch": args.arch,
        "kimi": args.kimi,
        "batch": r["batch"],
        "seq": r["seq"],
        "ttt": r["ttt"],
        "tokens_per_s": tok_s,
        "step_s": dt,
        "peak_gib": peak / 2**30,
        "reserved_gib": reserved / 2**30,
        "gflop_per_token": flops["total"] / 1e9,
        "gflop_terms": {k: x / 1e9 for k, x in flops.items()},
        "phases_ms": {k: x * 1000 for k, x in ph.items()},
        "argmax_once_ms": r["argmax_ms"],
        "prefetch": args.prefetch,
        "losses": r["losses"],
    }
    if r["multi"]:
        result |= multi_report(args, r, ranks, tokens, dt, say)
    if cuda and rank == 0:
        rate = matmul_rate(dev)
        mfu = tok_s * flops["total"] / rate
        say(
            f"bf16 matmul measured {rate / 1e12:.0f} TFLOP/s -> MFU {mfu:.1%}"
            f"{' per GPU' if world > 1 else ''}"
        )
        result |= {"matmul_tflops": rate / 1e12, "mfu": mfu}
    say(json.dumps(result))
    if args.json_out and rank == 0:
        args.json_out.write_text(json.dumps(result, indent=1))


def multi_report(args, r: dict, ranks: list, tokens: int, dt: float, say) -> dict:
    """Per-rank lines, the aggregate, the losses of every step, the scaling efficiency."""
    world, cuda = r["world"], r["dev"].type == "cuda"
    for x in ranks:
        mem = (
            f"{x['peak_gib']:.1f} GiB allocated / {x['reserved_gib']:.1f} GiB reserved"
            if cuda
            else f"{x['peak_gib']:.1f} GiB RSS"
        )
        say(
            f"  rank {x['rank']}: step {x['step_s'] * 1000:.0f} ms, "
            f"{x['tokens_per_s']:.0f} tokens/s, peak {mem}"
        )
    total = world * tokens / dt
    say(f"aggregate: {total:.0f} tokens/s over {world} rank(s) ({total / world:.0f} per rank)")
    say("loss per step (warm-up first): " + " ".join(f"{x:.6f}" for x in r["losses"]))
    out = {
        "mode": r["dist_info"].mode,
        "world_size": world,
        "accum": r["accum"],
        "aggregate_tokens_per_s": total,
        "ranks": ranks,
    }
    if args.single_tokens_per_s:
        eff = total / world / args.single_tokens_per_s
        say(f"scaling efficiency vs one GPU ({args.single_tokens_per_s:.0f} tokens/s): {eff:.1%}")
        out["scaling_efficiency"] = eff
    return out


if __name__ == "__main__":
    main()
