"""A single chat request against the served target, with its exact token ids.

Used as the serve stage's smoke check and by the demo: vLLM's
``extra_body={"return_token_ids": true}`` returns ``prompt_token_ids`` and
``choices[0].token_ids``, so nothing is re-tokenised.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import openai
from openai import AsyncOpenAI

from eagle3.signals import run_async


@dataclass
class ChatResult:
    model: str
    content: str
    reasoning: str | None
    finish_reason: str
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    latency_s: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def reasoning_of(message: dict[str, Any]) -> str | None:
    """vLLM >= 0.16 sends ``reasoning``; older servers ``reasoning_content``. Accept both: reading
    the wrong one silently lost all the thinking in the seed run."""
    return message.get("reasoning") or message.get("reasoning_content") or None


async def achat(
    base_url: str,
    model: str,
    messages: list[dict[str, str]],
    *,
    max_tokens: int = 64,
    temperature: float = 0.0,
    api_key: str | None = None,
    timeout_s: float = 600,
    extra_body: dict[str, Any] | None = None,
) -> ChatResult:
    client = AsyncOpenAI(
        base_url=f"{base_url}/v1",
        api_key=api_key or "EMPTY",
        timeout=openai.Timeout(timeout_s, connect=30.0),
        max_retries=0,
    )
    t0 = time.perf_counter()
    try:
        resp = await client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=max_tokens,
            temperature=temperature,
            extra_body={"return_token_ids": True, **(extra_body or {})},
        )
    finally:
        await client.close()
    choice = resp.choices[0]
    extra = resp.model_extra or {}
    return ChatResult(
        model=resp.model,
        content=choice.message.content or "",
        reasoning=reasoning_of(choice.message.model_dump()),
        finish_reason=choice.finish_reason,
        prompt_token_ids=list(extra.get("prompt_token_ids") or []),
        completion_token_ids=list((choice.model_extra or {}).get("token_ids") or []),
        latency_s=time.perf_counter() - t0,
    )


def chat(base_url: str, model: str, prompt: str, **kw: Any) -> ChatResult:
    return run_async(achat(base_url, model, [{"role": "user", "content": prompt}], **kw))
