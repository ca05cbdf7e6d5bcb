"""Send a workload's conversations to one server and time it from the client side.

Each conversation runs its turns in order (turn 2 carries the server's own turn-1 answer);
``concurrency`` conversations are in flight at once. Requests ask for exact token ids
(``return_token_ids``) so the two servers' outputs are compared token for token.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import openai
from openai import AsyncOpenAI

from eagle3.signals import run_async
from eagle3.verify.workload import Conversation


@dataclass
class TurnResult:
    conversation: str
    turn: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    latency_s: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class WorkloadRun:
    concurrency: int
    wall_s: float
    results: list[TurnResult]

    @property
    def output_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.results)

    def client_stats(self) -> dict[str, Any]:
        tokens = self.output_tokens
        lat = sum(r.latency_s for r in self.results)
        return {
            "concurrency": self.concurrency,
            "requests": len(self.results),
            "output_tokens": tokens,
            "wall_s": round(self.wall_s, 3),
            "output_tokens_per_s": tokens / self.wall_s if self.wall_s > 0 else None,
            # request latency / its output tokens, averaged over tokens (includes prefill)
            "client_latency_per_output_token_s": lat / tokens if tokens else None,
        }


def _client(base_url: str, api_key: str | None, timeout_s: float) -> AsyncOpenAI:
    return AsyncOpenAI(
        base_url=f"{base_url}/v1",
        api_key=api_key or "EMPTY",
        timeout=openai.Timeout(timeout_s, connect=30.0),
        max_retries=0,
    )


async def _turn(
    client: AsyncOpenAI,
    model: str,
    messages: list[dict[str, str]],
    conv: str,
    turn: int,
    max_tokens: int,
    temperature: float,
    seed: int | None,
) -> TurnResult:
    t0 = time.perf_counter()
    resp = await client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=temperature,
        seed=seed,
        extra_body={"return_token_ids": True},
    )
    choice = resp.choices[0]
    return TurnResult(
        conversation=conv,
        turn=turn,
        prompt_token_ids=list((resp.model_extra or {}).get("prompt_token_ids") or []),
        token_ids=list((choice.model_extra or {}).get("token_ids") or []),
        text=choice.message.content or "",
        finish_reason=choice.finish_reason,
        latency_s=time.perf_counter() - t0,
    )


async def _run(
    base_url: str,
    model: str,
    convs: list[Conversation],
    concurrency: int,
    max_tokens: int,
    temperature: float,
    seed: int,
    api_key: str | None,
    timeout_s: float,
    on_result: Callable[[TurnResult], None] | None,
) -> WorkloadRun:
    client = _client(base_url, api_key, timeout_s)
    sem = asyncio.Semaphore(concurrency)
    results: list[TurnResult] = []

    async def one(conv: Conversation) -> None:
        async with sem:
            messages: list[dict[str, str]] = []
            for i, text in enumerate(conv.turns):
                messages.append({"role": "user", "content": text})
                r = await _turn(
                    client,
                    model,
                    messages,
                    conv.id,
                    i,
                    max_tokens,
                    temperature,
                    None if temperature == 0 else seed,
                )
                results.append(r)
                if on_result is not None:
                    on_result(r)
                messages.append({"role": "assistant", "content": r.text})

    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(one(c) for c in convs))
    finally:
        await client.close()
    wall = time.perf_counter() - t0
    results.sort(key=lambda r: (r.conversation, r.turn))
    return WorkloadRun(concurrency, wall, results)


def run_workload(
    base_url: str,
    model: str,
    convs: list[Conversation],
    *,
    concurrency: int,
    max_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    api_key: str | None = None,
    timeout_s: float = 600,
    on_result: Callable[[TurnResult], None] | None = None,
) -> WorkloadRun:
    return run_async(
        _run(
            base_url,
            model,
            convs,
            concurrency,
            max_tokens,
            temperature,
            seed,
            api_key,
            timeout_s,
            on_result,
        )
    )


def warmup(
    base_url: str, model: str, n: int, api_key: str | None = None, timeout_s: float = 600
) -> None:
    """A few short requests outside the measured window (first-request costs, lazy init)."""
    if n <= 0:
        return
    convs = [Conversation(f"warmup-{i}", ("Say hello in five words.",)) for i in range(n)]
    run_workload(
        base_url, model, convs, concurrency=n, max_tokens=16, api_key=api_key, timeout_s=timeout_s
    )


def compare_outputs(base: WorkloadRun, spec: WorkloadRun) -> dict[str, Any]:
    """Token-for-token comparison of the same (conversation, turn) on both servers.

    Under greedy decoding speculative decoding must not change the output; a mismatch that
    starts early points at an integration bug, one that starts late at numerics (bf16 batch
    shapes differ between a verify pass and a decode step)."""
    b = {(r.conversation, r.turn): r for r in base.results}
    mismatches = []
    for r in spec.results:
        o = b.get((r.conversation, r.turn))
        if o is None:
            continue
        if o.token_ids != r.token_ids:
            first = next(
                (i for i, (x, y) in enumerate(zip(o.token_ids, r.token_ids)) if x != y),
                min(len(o.token_ids), len(r.token_ids)),
            )
            mismatches.append(
                {
                    "conversation": r.conversation,
                    "turn": r.turn,
                    "first_diff": first,
                    "baseline_tokens": len(o.token_ids),
                    "speculative_tokens": len(r.token_ids),
                }
            )
    compared = sum(1 for r in spec.results if (r.conversation, r.turn) in b)
    return {
        "compared": compared,
        "mismatches": len(mismatches),
        "mismatch_fraction": len(mismatches) / compared if compared else None,
        "details": mismatches,
    }
