"""Generate-stage throughput, side by side in one run.

    .venv/bin/python bench/generate_throughput.py [--samples 96] [--levels 1,8,32,64,128] [--skip-vllm]

(a) Against the real vLLM CPU server (SmolLM2, the embedded profile): the generate stage's own
    output tokens/s at fixed concurrencies, and with `concurrency: auto` (profile, then generate
    at the knee). Every run uses the same prompts and fixed-length outputs (ignore_eos) so the
    levels are comparable; auto must reach >= 97% of the best fixed level.
(b) Against a zero-work local OpenAI-compatible server (bench/zero_server.py): requests/s the
    client sustains through the full stage (storage included). Goal: >= 1000 req/s here, so the
    client is never the bottleneck.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from eagle3.config import load_config  # noqa: E402
from eagle3.embedded import prepare_model  # noqa: E402
from eagle3.generate.profile import profile_concurrency  # noqa: E402
from eagle3.generate.runner import generate  # noqa: E402
from eagle3.serving.readiness import free_port  # noqa: E402
from eagle3.serving.server import start_server  # noqa: E402


def prompts_file(n: int) -> Path:
    path = Path(tempfile.mkdtemp(prefix="bench-gen-")) / "prompts.jsonl"
    topics = [
        "the ocean",
        "a city at night",
        "mathematics",
        "a friendly robot",
        "autumn",
        "coffee",
        "trains",
        "music",
    ]
    with open(path, "w") as f:
        for i in range(n):
            f.write(
                json.dumps(
                    {"prompt": f"Write a short paragraph about {topics[i % len(topics)]} (#{i})."}
                )
                + "\n"
            )
    return path


def run_fixed(cfg, urls, concurrency, token_check: bool = True) -> dict:
    out = Path(tempfile.mkdtemp(prefix="bench-gen-out-"))
    m = generate(cfg, urls, out, concurrency=concurrency, token_check=token_check)
    r = m["this_run"]
    return {
        "concurrency": concurrency,
        "tokens_per_s": r["completion_tokens_per_s"],
        "requests_per_s": r["requests_per_s"],
        "samples": r["counts"].get("generated", 0),
        "wall_s": r["wall_s"],
    }


def bench_vllm(args) -> None:
    data = prompts_file(args.samples)
    cfg = load_config(
        ROOT / "configs" / "smollm2-cpu.yaml",
        [
            f"generate.dataset={data}",
            f"generate.num_samples={args.samples}",
            f"generate.max_tokens={args.max_tokens}",
            "generate.temperature=0",
            f"generate.profile_levels={[int(x) for x in args.levels.split(',')]}",
            f"generate.profile_prompts={args.profile_prompts}",
            f"generate.profile_max_tokens={args.max_tokens}",
            "generate.concurrency_ceiling=256",
            "serve.port=0",
        ],
    )
    model = str(prepare_model(cfg.paths.cache_dir, cfg.target.embedded_name))
    # fixed-length outputs so every level does the same work
    cfg.generate.chat_template_kwargs = {}
    with start_server(cfg, model, log_dir=tempfile.mkdtemp(prefix="bench-gen-logs-")) as server:
        urls = [server.base_url]
        import eagle3.generate.runner as runner

        original = runner._Run.request

        def fixed_length(self, prompt, max_tokens):
            req = original(self, prompt, max_tokens)
            req["ignore_eos"] = True
            return req

        runner._Run.request = fixed_length
        fixed = []
        for c in [int(x) for x in args.levels.split(",")]:
            fixed.append(run_fixed(cfg, urls, c))
            print(
                f"(a) fixed concurrency {c:4d}: {fixed[-1]['tokens_per_s']:8.1f} tok/s "
                f"({fixed[-1]['samples']} samples, {fixed[-1]['wall_s']:.1f} s)",
                flush=True,
            )
        t0 = time.perf_counter()
        report = profile_concurrency(cfg, urls)
        profile_s = time.perf_counter() - t0
        auto = run_fixed(cfg, urls, report["knee"])
        best = max(fixed, key=lambda r: r["tokens_per_s"])
        ratio = auto["tokens_per_s"] / best["tokens_per_s"]
        print(
            f"(a) auto: profile {profile_s:.1f} s picked {report['knee']} -> {auto['tokens_per_s']:.1f} tok/s; "
            f"best fixed {best['concurrency']} at {best['tokens_per_s']:.1f} tok/s; auto/best = {ratio:.3f} "
            f"({'meets' if ratio >= 0.97 else 'MISSES'} the 0.97 goal)",
            flush=True,
        )
        print(
            json.dumps(
                {
                    "fixed": fixed,
                    "auto": auto,
                    "profile": report["levels"],
                    "knee": report["knee"],
                    "auto_over_best": round(ratio, 4),
                }
            )
        )


def bench_client(args) -> None:
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, str(ROOT / "bench" / "zero_server.py"), str(port)], stdout=subprocess.PIPE
    )
    server.stdout.readline()
    try:
        data = prompts_file(args.client_requests)
        for c in (64, 256):
            cfg = load_config(
                ROOT / "configs" / "smollm2-cpu.yaml",
                [
                    f"generate.dataset={data}",
                    f"generate.num_samples={args.client_requests}",
                    "target.served_model_name=zero",
                    "generate.concurrency_ceiling=1000",
                ],
            )
            # the zero server's canned ids are nobody's: the client's ceiling, unchecked
            r = run_fixed(cfg, [f"http://127.0.0.1:{port}"], c, token_check=False)
            print(
                f"(b) zero-work server, concurrency {c}: {r['requests_per_s']:.0f} req/s through the whole stage "
                f"({r['samples']} samples in {r['wall_s']:.1f} s; goal >= 1000)",
                flush=True,
            )
    finally:
        server.kill()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--levels", default="8,32,64,128")
    ap.add_argument("--profile-prompts", type=int, default=32)
    ap.add_argument("--client-requests", type=int, default=20000)
    ap.add_argument("--skip-vllm", action="store_true")
    args = ap.parse_args()
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores; {time.strftime('%Y-%m-%d %H:%M')}"
    )
    bench_client(args)
    if not args.skip_vllm:
        bench_vllm(args)


if __name__ == "__main__":
    main()
