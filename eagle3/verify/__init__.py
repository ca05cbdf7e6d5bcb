"""Verify stage: baseline vs speculative vLLM server, acceptance from /metrics, speedup, gate.

Names are imported on first use, so that the offline parts (``eagle3.verify.offline``,
``eagle3.verify.ngram``) load without the HTTP client stack (openai, aiohttp): a GPU machine that
only trains and scores drafts needs neither."""

from typing import Any

__all__ = ["GateFailed", "offline_acceptance", "verify"]


def __getattr__(name: str) -> Any:
    if name == "GateFailed":
        from eagle3.verify.gate import GateFailed

        return GateFailed
    if name == "offline_acceptance":
        from eagle3.verify.offline import offline_acceptance

        return offline_acceptance
    if name == "verify":
        from eagle3.verify.runner import verify

        return verify
    raise AttributeError(f"module 'eagle3.verify' has no attribute {name!r}")
