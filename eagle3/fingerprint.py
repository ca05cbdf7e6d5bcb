"""Tokenizer fingerprints that both the server and a local tokenizer can compute.

The generate stage never loads a tokenizer (the server tokenises), yet extract and train must
use exactly the server's tokenizer and chat template: token ids from one tokenizer fed to a
model expecting another are silent garbage. So the fingerprint is behavioural: the ids that a
fixed probe conversation gets through the chat template, hashed. The server computes them with
vLLM's ``/tokenize``, a local tokenizer with ``apply_chat_template``; equal hashes mean the same
vocabulary, merges, special tokens and template for everything the probe touches.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import httpx

PROBE_MESSAGES = [
    {"role": "system", "content": "You are a careful assistant."},
    {
        "role": "user",
        "content": "Größe ≈ 3.14159; naïve café — 東京 🚀 def f(x):\n\treturn x**2  # <tag> 0x1F",
    },
]


def fingerprint_ids(ids: list[int]) -> str:
    return hashlib.sha256(json.dumps([int(i) for i in ids]).encode()).hexdigest()[:16]


def local_fingerprint(tokenizer: Any, chat_template_kwargs: dict[str, Any] | None = None) -> str:
    ids = tokenizer.apply_chat_template(
        PROBE_MESSAGES,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        **(chat_template_kwargs or {}),
    )["input_ids"]
    return fingerprint_ids(list(ids))


def server_fingerprint(
    base_url: str,
    model: str,
    chat_template_kwargs: dict[str, Any] | None = None,
    api_key: str | None = None,
) -> str | None:
    """None when the server has no /tokenize (not vLLM)."""
    body = {"model": model, "messages": PROBE_MESSAGES, "add_generation_prompt": True}
    if chat_template_kwargs:
        body["chat_template_kwargs"] = chat_template_kwargs
    try:
        r = httpx.post(
            f"{base_url}/tokenize",
            json=body,
            timeout=30,
            headers={"Authorization": f"Bearer {api_key}"} if api_key else {},
        )
        if r.status_code != 200:
            return None
        return fingerprint_ids(r.json()["tokens"])
    except (httpx.HTTPError, KeyError, ValueError):
        return None
