"""What the generate stage stores per sample: :func:`build_record` turns one chat completion into
the stored record (text, reasoning, exact token ids from the server or rebuilt from the chat
template, flags)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from eagle3.generate.prompts import Prompt
from eagle3.serving.client import reasoning_of


def build_record(
    prompt: Prompt,
    resp: dict[str, Any],
    endpoint: str,
    attempts: int,
    latency: float,
    expects_reasoning: bool,
    rebuild: Callable[..., tuple[list[int], list[int]]] | None,
) -> dict[str, Any]:
    choice = resp["choices"][0]
    msg = choice.get("message") or {}
    reasoning = reasoning_of(msg)
    content = msg.get("content")
    prompt_ids = resp.get("prompt_token_ids")
    completion_ids = choice.get("token_ids")
    source = "server"
    if not prompt_ids or completion_ids is None:
        if rebuild is None:
            raise RuntimeError(
                "server returned no token ids and no tokenizer is configured to rebuild them"
            )
        prompt_ids, completion_ids = rebuild(
            prompt.messages, reasoning, content, choice.get("finish_reason")
        )
        source = "rebuilt"
    flags = []
    if expects_reasoning and not reasoning:
        flags.append("no_reasoning")
    if choice.get("finish_reason") == "length":
        flags.append("truncated")
    return {
        "id": prompt.id,
        "source": prompt.source_index,
        "messages": prompt.messages,
        "reasoning": reasoning,
        "content": content,
        "finish_reason": choice.get("finish_reason"),
        "truncated": choice.get("finish_reason") == "length",
        "prompt_token_ids": list(prompt_ids),
        "completion_token_ids": list(completion_ids),
        "token_ids_source": source,
        "usage": resp.get("usage"),
        "latency_s": round(latency, 4),
        "attempts": attempts,
        "endpoint": endpoint,
        "model": resp.get("model"),
        "flags": flags,
    }
