"""Concurrency profiling: sweep in-flight levels against the live server and pick the knee.

The seed run found Kimi-K2.5's throughput flat above 128 in flight (about 1536 tok/s); more
in flight only adds latency. ``profile_concurrency`` measures that curve for any server with a
fixed prompt sample and fixed-length outputs (``ignore_eos``), so levels are comparable, and
picks the smallest level within ``knee`` (default 97%) of the best throughput.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path
from typing import Any

from eagle3.atomic import write_json_atomic
from eagle3.config import PipelineConfig
from eagle3.generate.client import RetryPolicy, chat_request, make_pool
from eagle3.generate.prompts import Prompt, PromptStats
from eagle3.signals import run_async


def pick_knee(levels: list[dict[str, Any]], knee: float) -> int:
    best = max(r["tokens_per_s"] for r in levels)
    return min(r["concurrency"] for r in levels if r["tokens_per_s"] >= knee * best)


async def _level(
    cfg: PipelineConfig, base_urls: list[str], prompts: list[Prompt], level: int
) -> dict[str, Any]:
    g = cfg.generate
    pool = make_pool(
        base_urls,
        api_key=cfg.serve.api_key,
        timeout_s=g.timeout_s,
        connect_timeout_s=g.connect_timeout_s,
        max_connections=level,
        strategy=g.balancing,
    )
    policy = RetryPolicy(g.max_attempts, g.backoff_base_s, g.backoff_max_s)
    sem = asyncio.Semaphore(level)
    latencies: list[float] = []
    tokens = 0

    async def one(p: Prompt) -> None:
        nonlocal tokens
        req = {
            "model": cfg.target.served_model_name,
            "messages": p.messages,
            "max_tokens": g.profile_max_tokens,
            "temperature": g.temperature,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        if g.chat_template_kwargs:
            req["chat_template_kwargs"] = g.chat_template_kwargs
        async with sem:
            resp, _, _, latency = await chat_request(pool, req, policy)
        latencies.append(latency)
        tokens += resp["usage"]["completion_tokens"]

    # at least two full waves per level so the level is really reached
    n = max(len(prompts), 2 * level)
    batch = [prompts[i % len(prompts)] for i in range(n)]
    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(one(p) for p in batch))
    finally:
        await pool.close()
    wall = time.perf_counter() - t0
    lat = sorted(latencies)
    return {
        "concurrency": level,
        "requests": n,
        "tokens_per_s": round(tokens / wall, 2),
        "requests_per_s": round(n / wall, 3),
        "latency_p50_s": round(statistics.median(lat), 3),
        "latency_p95_s": round(lat[min(len(lat) - 1, int(0.95 * len(lat)))], 3),
        "wall_s": round(wall, 2),
    }


def profile_concurrency(
    cfg: PipelineConfig,
    base_urls: list[str],
    out_dir: Path | None = None,
    levels: list[int] | None = None,
    on_level=None,
) -> dict[str, Any]:
    """Sweep levels (capped by ``concurrency_ceiling``); returns and saves {levels, best, knee}."""
    from eagle3.generate.runner import load_prompts

    g = cfg.generate
    levels = sorted({lv for lv in (levels or g.profile_levels) if lv <= g.concurrency_ceiling}) or [
        g.concurrency_ceiling
    ]
    prompts: list[Prompt] = []
    for item in load_prompts(cfg, PromptStats()):
        if isinstance(item, Prompt):
            prompts.append(item)
            if len(prompts) >= g.profile_prompts:
                break
    if not prompts:
        raise ValueError(f"no usable prompts in {g.dataset} to profile with")
    results = []
    for lv in levels:
        r = run_async(_level(cfg, base_urls, prompts, lv))
        results.append(r)
        if on_level:
            on_level(r)
    knee = pick_knee(results, g.profile_knee)
    best = max(results, key=lambda r: r["tokens_per_s"])
    report = {
        "levels": results,
        "best": best["concurrency"],
        "best_tokens_per_s": best["tokens_per_s"],
        "knee": knee,
        "knee_fraction": g.profile_knee,
        "max_tokens": g.profile_max_tokens,
        "prompts": len(prompts),
        "endpoints": base_urls,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if out_dir is not None:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(out_dir / "concurrency-profile.json", report)
        plot_profile(report, out_dir / "concurrency-profile.png")
    return report


def plot_profile(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["concurrency"] for r in report["levels"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(xs, [r["tokens_per_s"] for r in report["levels"]], "o-", label="output tokens/s")
    ax.axvline(report["knee"], color="tab:green", ls="--", label=f"knee = {report['knee']}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("requests in flight")
    ax.set_ylabel("output tokens/s")
    ax2 = ax.twinx()
    ax2.plot(
        xs,
        [r["latency_p50_s"] for r in report["levels"]],
        "s:",
        color="tab:red",
        label="p50 latency (s)",
    )
    ax2.set_ylabel("p50 latency (s)")
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="lower right")
    ax.set_title("Concurrency profile")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
