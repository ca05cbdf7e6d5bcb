"""Server start time and first-request latency of the serve stage, side by side.

    .venv/bin/python bench/serve_startup.py [--config configs/smollm2-cpu.yaml] [--repeats 2] \
        [--variants profile multiproc]

For each variant it starts the real server through the process backend and prints:
  start_s          spawn -> /health and /v1/models answer
  first_request_s  the first chat completion after ready (16 tokens, greedy)
  warm_request_s   the same request again
  tok_s_c1/c8      output tokens/s of 8 (c=1) and 32 (c=8) chat completions of 64 tokens each
                   (greedy, ignore_eos: every request decodes exactly 64)
  stop_s           SIGTERM -> every process of the group gone

Variants: ``profile`` (the profile as is: `-O0`, the uni executor in the engine process),
``multiproc`` (vLLM's default CPU layout: the model in a worker process of its own) and
``compile`` (vLLM's default torch.compile mode, the profile's layout; ~90 s a start).
The first variant is the reference of the printed ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import tempfile
import time

from eagle3.config import load_config
from eagle3.embedded import prepare_model
from eagle3.serving.client import achat, chat
from eagle3.serving.server import start_server

VARIANTS = {
    "profile": [],
    "multiproc": ['serve.extra_args=["-O0"]', 'serve.env={"VLLM_CPU_KVCACHE_SPACE": "2"}'],
    "compile": ['serve.extra_args=["--distributed-executor-backend", "uni"]'],
}
PROMPTS = [
    "Write a short story about a robot.",
    "Explain photosynthesis.",
    "List five fruits and describe each.",
    "What is the capital of France? Explain its history.",
]


async def tokens_per_s(base_url: str, model: str, concurrency: int, n: int) -> float:
    """Output tokens/s of ``n`` requests of exactly 64 tokens, ``concurrency`` in flight."""
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> int:
        async with sem:
            r = await achat(
                base_url,
                model,
                [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                max_tokens=64,
                extra_body={"ignore_eos": True},
            )
            return len(r.completion_token_ids)

    t0 = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(i) for i in range(n))))
    return tokens / (time.perf_counter() - t0)


def measure(config: str, overrides: list[str], model: str) -> dict[str, float]:
    cfg = load_config(config, ["serve.poll_interval_s=0.2", *overrides])
    t0 = time.perf_counter()
    server = start_server(cfg, model, log_dir=tempfile.mkdtemp(prefix="bench-serve-"))
    start_s = time.perf_counter() - t0
    try:
        first = chat(
            server.base_url, server.model, "Name a primary color.", max_tokens=16
        ).latency_s
        warm = chat(server.base_url, server.model, "Name a primary color.", max_tokens=16).latency_s
        c1 = asyncio.run(tokens_per_s(server.base_url, server.model, 1, 8))
        c8 = asyncio.run(tokens_per_s(server.base_url, server.model, 8, 32))
    finally:
        t1 = time.perf_counter()
        server.stop()
        stop_s = time.perf_counter() - t1
    return {
        "start_s": start_s,
        "first_request_s": first,
        "warm_request_s": warm,
        "tok_s_c1": c1,
        "tok_s_c8": c8,
        "stop_s": stop_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/smollm2-cpu.yaml")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument(
        "--variants", nargs="*", default=["profile", "multiproc"], choices=list(VARIANTS)
    )
    args = ap.parse_args()
    cfg = load_config(args.config)
    model = (
        str(prepare_model(cfg.paths.cache_dir, cfg.target.embedded_name))
        if cfg.target.is_embedded
        else cfg.target.model
    )
    print(
        f"machine: {platform.node()} {platform.processor() or platform.machine()}, "
        f"{__import__('os').cpu_count()} cores; {time.strftime('%Y-%m-%d %H:%M')}; profile {cfg.name}"
    )
    results = {}
    for name in args.variants:
        runs = [measure(args.config, VARIANTS[name], model) for _ in range(args.repeats)]
        results[name] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(
            f"{name:18s} " + "  ".join(f"{k}={v:7.2f}" for k, v in results[name].items()),
            flush=True,
        )
    ref_name, ref = next(iter(results.items()))
    for name, r in list(results.items())[1:]:
        print(
            f"ratio {name}/{ref_name}: "
            + ", ".join(f"{k} {r[k] / ref[k]:.2f}x" for k in ref if ref[k] > 0)
        )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
