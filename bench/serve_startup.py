"""Server start time and first-request latency of the serve stage, side by side.

    .venv/bin/python bench/serve_startup.py [--config configs/smollm2-cpu.yaml] [--repeats 2]

For each variant (the profile as is: `-O0`, no torch.compile; and vLLM's default compile
mode) it starts the real server through the process backend and prints:
  start_s          spawn -> /health and /v1/models answer
  first_request_s  the first chat completion after ready (16 tokens, greedy)
  warm_request_s   the same request again
  stop_s           SIGTERM -> every process of the group gone
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time

from eagle3.config import load_config
from eagle3.embedded import prepare_model
from eagle3.serving.client import chat
from eagle3.serving.server import start_server

VARIANTS = {"O0 (profile)": [], "default compile": ["serve.extra_args=[]"]}


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
    finally:
        t1 = time.perf_counter()
        server.stop()
        stop_s = time.perf_counter() - t1
    return {"start_s": start_s, "first_request_s": first, "warm_request_s": warm, "stop_s": stop_s}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/smollm2-cpu.yaml")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS))
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
    if len(results) == 2:
        a, b = results.values()
        print(
            f"ratio default/O0: start {b['start_s'] / a['start_s']:.2f}x, "
            f"first request {b['first_request_s'] / a['first_request_s']:.2f}x, "
            f"warm request {b['warm_request_s'] / a['warm_request_s']:.2f}x"
        )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
