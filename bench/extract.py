"""Extract-stage throughput and storage cost, side by side in one run.

    .venv/bin/python bench/extract.py                      # CPU: the embedded SmolLM2
    python bench/extract.py --random-llama-8b             # GPU: Llama-3.1-8B dimensions, random weights

For the same length-bucketed batches of the same sequences it measures
  bare      the base model's forward alone (no hooks, outputs dropped): the ceiling
  backend   the HF backend as the stage runs it: hooks on the aux layers and the last layer,
            states copied to the CPU, samples written to sharded safetensors (bf16)
and prints backend/bare (goal >= 0.90), plus bytes/token of bf16 and fp8 storage.
With --random-llama-8b it also measures the GPU's bf16 matmul rate and reports the backend's
tokens/s against the forward-FLOP floor (2 x non-embedding params per token + attention).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from gpu import matmul_rate, sync  # noqa: E402

from eagle3.batching import token_budget_batches  # noqa: E402
from eagle3.extract.hf_backend import LayerTap, forward_states, load_base_model, pick_device  # noqa: E402
from eagle3.extract.storage import Sample, ShardWriter  # noqa: E402


def make_sequences(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(0, vocab, (t,), generator=g).tolist() for t in lengths]


@torch.inference_mode()
def bare_forward(model, batches, seqs, device) -> float:
    tokens = 0
    sync(device)
    t0 = time.perf_counter()
    for b in batches:
        longest = max(len(seqs[i]) for i in b)
        ids = torch.zeros((len(b), longest), dtype=torch.long)
        mask = torch.zeros((len(b), longest), dtype=torch.long)
        for r, i in enumerate(b):
            ids[r, : len(seqs[i])] = torch.tensor(seqs[i])
            mask[r, : len(seqs[i])] = 1
        model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False)
        tokens += sum(len(seqs[i]) for i in b)
    sync(device)
    return tokens / (time.perf_counter() - t0)


def disk_write_rate(root: str | None, mb: int = 2048) -> float:
    """Sequential write + fsync rate of the output disk (bytes/s): the ceiling for storing states."""
    path = Path(tempfile.mkdtemp(prefix="bench-disk-", dir=root)) / "blob"
    block = os.urandom(1 << 20) * 64
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(mb // 64):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    rate = mb * (1 << 20) / (time.perf_counter() - t0)
    path.unlink()
    return rate


def backend(
    model, batches, seqs, device, aux_layers, storage_dtype, root: str | None = None
) -> tuple[float, float]:
    out = Path(tempfile.mkdtemp(prefix="bench-extract-", dir=root))
    writer = ShardWriter(
        out, storage_dtype, samples_per_shard=8
    )  # several shards: writes overlap compute
    tap = LayerTap(model, aux_layers)
    tokens = 0
    sync(device)
    t0 = time.perf_counter()
    for b in batches:
        for i, (aux, final) in zip(b, forward_states(model, tap, [seqs[i] for i in b], device)):
            n = len(seqs[i])
            writer.add(
                Sample(f"s{i}", torch.tensor(seqs[i]), torch.ones(n, dtype=torch.bool), aux, final)
            )
            tokens += n
    writer.close()
    sync(device)
    rate = tokens / (time.perf_counter() - t0)
    tap.remove()
    return rate, writer.bytes_written / tokens


def random_llama_8b(device: torch.device):
    from transformers import LlamaConfig, LlamaModel

    cfg = LlamaConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=8192,
        rope_theta=500000.0,
    )
    cfg._attn_implementation = "sdpa"
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):
        model = LlamaModel(cfg)
    torch.set_default_dtype(torch.float32)
    return model.eval(), cfg


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--min-len", type=int, default=128)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--token-budget", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--random-llama-8b", action="store_true")
    ap.add_argument(
        "--out-root", default=None, help="where shards are written (default: the temp dir)"
    )
    ap.add_argument(
        "--also-out-root", default=None, help="a second location to compare, e.g. /dev/shm"
    )
    ap.add_argument(
        "--vllm", action="store_true", help="also the vLLM backend (CPU profile, its own server)"
    )
    args = ap.parse_args()
    device = pick_device("auto")
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, device {device}"
        f"{' ' + torch.cuda.get_device_name() if device.type == 'cuda' else ''}; torch {torch.__version__}; "
        f"{time.strftime('%Y-%m-%d %H:%M')}"
    )
    if args.random_llama_8b:
        model, cfg = random_llama_8b(device)
        label = "Llama-3.1-8B dims, random weights, bf16"
    else:
        from eagle3.config import load_config
        from eagle3.embedded import prepare_model

        pc = load_config(ROOT / "configs" / "smollm2-cpu.yaml")
        path = prepare_model(pc.paths.cache_dir, pc.target.embedded_name)
        model = load_base_model(
            str(path), device, torch.bfloat16 if device.type == "cuda" else torch.float32
        )
        cfg = model.config
        label = f"SmolLM2-135M, {next(model.parameters()).dtype}"
    n_layers = cfg.num_hidden_layers
    aux = [2, n_layers // 2, n_layers - 3]
    seqs = make_sequences(args.samples, args.min_len, args.max_len, cfg.vocab_size)
    batches = token_budget_batches([len(s) for s in seqs], args.token_budget)
    print(
        f"model: {label}; {args.samples} sequences of {args.min_len}-{args.max_len} tokens, "
        f"{len(batches)} batches under a {args.token_budget}-token budget; aux layers {aux}"
    )
    bare_forward(model, batches[:1], seqs, device)  # warm-up
    bare = max(bare_forward(model, batches, seqs, device) for _ in range(args.repeats))
    runs = [
        backend(model, batches, seqs, device, aux, "bfloat16", args.out_root)
        for _ in range(args.repeats)
    ]
    rate, bpt_bf16 = max(runs)
    rate_fp8, bpt_fp8 = backend(model, batches, seqs, device, aux, "float8_e4m3fn", args.out_root)
    disk = disk_write_rate(args.out_root)
    print(f"bare forward     {bare:10.1f} tok/s")
    print(
        f"HF backend       {rate:10.1f} tok/s  -> backend/bare = {rate / bare:.3f} (goal >= 0.90)"
    )
    print(f"HF backend fp8   {rate_fp8:10.1f} tok/s  -> backend/bare = {rate_fp8 / bare:.3f}")
    print(
        f"storage          bf16 {bpt_bf16:.0f} bytes/token, fp8 {bpt_fp8:.0f} bytes/token "
        f"(fp8/bf16 = {bpt_fp8 / bpt_bf16:.3f}; H = {cfg.hidden_size}, 4H states per token)"
    )
    print(
        f"output disk      {disk / 1e6:.0f} MB/s write+fsync -> at most {disk / bpt_bf16:.0f} tok/s in bf16, "
        f"{disk / bpt_fp8:.0f} tok/s in fp8"
    )
    if args.also_out_root:
        r2, _ = max(
            backend(model, batches, seqs, device, aux, "bfloat16", args.also_out_root)
            for _ in range(args.repeats)
        )
        print(
            f"HF backend -> {args.also_out_root}: {r2:10.1f} tok/s -> backend/bare = {r2 / bare:.3f} "
            f"(storage on {args.also_out_root}: what the stage costs when the disk is not the limit)"
        )
    result = {
        "bare_tok_s": bare,
        "backend_tok_s": rate,
        "ratio": rate / bare,
        "bytes_per_token_bf16": bpt_bf16,
        "bytes_per_token_fp8": bpt_fp8,
    }
    if device.type == "cuda":
        peak = matmul_rate(device)
        params = sum(p.numel() for n, p in model.named_parameters() if "embed" not in n)
        mean_len = sum(len(s) for s in seqs) / len(seqs)
        # per token: 2 flops per weight, plus causal attention QK^T and PV (2 x 2 x T/2 x d per layer)
        flops_per_token = 2 * params + 2 * 2 * (mean_len / 2) * cfg.hidden_size * n_layers
        floor = peak / flops_per_token
        print(
            f"GPU bf16 matmul  {peak / 1e12:.0f} TFLOP/s measured (8192^3); forward floor {floor:.0f} tok/s "
            f"({flops_per_token / 1e9:.1f} GFLOP/token) -> backend at {rate / floor:.1%} of the floor, "
            f"bare at {bare / floor:.1%}"
        )
        result |= {
            "matmul_tflops": peak / 1e12,
            "floor_tok_s": floor,
            "backend_vs_floor": rate / floor,
        }
    if args.vllm:
        result["vllm_tok_s"] = bench_vllm(seqs, aux)
    print(json.dumps(result))


def bench_vllm(seqs: list[list[int]], aux: list[int]) -> float:
    """The vLLM backend on the same sequences: tokens/s after the first result (server start excluded)."""
    from eagle3.config import load_config
    from eagle3.embedded import prepare_model
    from eagle3.extract.vllm_backend import extract_vllm

    cfg = load_config(ROOT / "configs" / "smollm2-cpu.yaml", ["serve.port=0"])
    model = str(prepare_model(cfg.paths.cache_dir, cfg.target.embedded_name))
    t0 = time.perf_counter()
    first = None
    tokens = 0
    lengths = {f"s{i}": len(s) for i, s in enumerate(seqs)}
    for sid, _ in extract_vllm(
        cfg,
        model,
        ((f"s{i}", s) for i, s in enumerate(seqs)),
        [*aux, cfg.target.num_hidden_layers],
        Path(tempfile.mkdtemp(prefix="bench-vllm-")),
    ):
        if first is None:
            first = time.perf_counter()
        else:
            tokens += lengths[sid]
    rate = tokens / (time.perf_counter() - first)
    print(
        f"vLLM backend     {rate:10.1f} tok/s after a {first - t0:.1f} s server start "
        f"(bf16 in vLLM's CPU kernels; {len(seqs)} sequences, concurrency 8)"
    )
    return rate


if __name__ == "__main__":
    main()
