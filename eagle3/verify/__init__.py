"""Verify stage: baseline vs speculative vLLM server, acceptance from /metrics, speedup, gate."""

from eagle3.verify.gate import GateFailed
from eagle3.verify.offline import offline_acceptance
from eagle3.verify.runner import verify

__all__ = ["GateFailed", "offline_acceptance", "verify"]
