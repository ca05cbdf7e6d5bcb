"""Speculative-decoding counters from vLLM's Prometheus ``/metrics``.

vLLM (v1) exports, per engine:
  vllm:spec_decode_num_drafts_total                 drafts proposed (one per request per step)
  vllm:spec_decode_num_draft_tokens_total           draft tokens proposed (k per draft)
  vllm:spec_decode_num_accepted_tokens_total        draft tokens accepted
  vllm:spec_decode_num_accepted_tokens_per_pos_total{position="i"}
and latency histograms (``_sum``/``_count``) such as vllm:request_time_per_output_token_seconds.
Counters only grow, so a measured window is the difference of two snapshots taken around it;
derived figures follow vLLM's own dashboard definitions:
  mean acceptance length = 1 + accepted / drafts  (the bonus token counts)
  acceptance rate        = accepted / draft tokens
  acceptance at position i = accepted_per_pos[i] / drafts
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import httpx

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')

HISTOGRAMS = {
    "tpot": "vllm:request_time_per_output_token_seconds",
    "ttft": "vllm:time_to_first_token_seconds",
    "e2e": "vllm:e2e_request_latency_seconds",
}


def parse_prometheus(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(name, sorted labels): value} for every sample line."""
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            continue
        labels = tuple(sorted(_LABEL.findall(m.group(2) or "")))
        try:
            out[(m.group(1), labels)] = float(m.group(3))
        except ValueError:
            continue
    return out


def _sum(samples: dict, name: str, **match: str) -> float:
    """Sum over engines (and any label not in ``match``)."""
    total = 0.0
    for (n, labels), v in samples.items():
        if n == name and all(dict(labels).get(k) == val for k, val in match.items()):
            total += v
    return total


@dataclass
class Snapshot:
    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    accepted_per_pos: dict[int, float] = field(default_factory=dict)
    generation_tokens: float = 0.0
    hist_sum: dict[str, float] = field(default_factory=dict)
    hist_count: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_text(cls, text: str) -> Snapshot:
        s = parse_prometheus(text)
        per_pos: dict[int, float] = {}
        for (n, labels), v in s.items():
            if n == "vllm:spec_decode_num_accepted_tokens_per_pos_total":
                pos = int(dict(labels).get("position", -1))
                per_pos[pos] = per_pos.get(pos, 0.0) + v
        return cls(
            drafts=_sum(s, "vllm:spec_decode_num_drafts_total"),
            draft_tokens=_sum(s, "vllm:spec_decode_num_draft_tokens_total"),
            accepted=_sum(s, "vllm:spec_decode_num_accepted_tokens_total"),
            accepted_per_pos=per_pos,
            generation_tokens=_sum(s, "vllm:generation_tokens_total"),
            hist_sum={k: _sum(s, f"{n}_sum") for k, n in HISTOGRAMS.items()},
            hist_count={k: _sum(s, f"{n}_count") for k, n in HISTOGRAMS.items()},
        )

    def __sub__(self, before: Snapshot) -> Snapshot:
        return Snapshot(
            drafts=self.drafts - before.drafts,
            draft_tokens=self.draft_tokens - before.draft_tokens,
            accepted=self.accepted - before.accepted,
            accepted_per_pos={
                p: v - before.accepted_per_pos.get(p, 0.0) for p, v in self.accepted_per_pos.items()
            },
            generation_tokens=self.generation_tokens - before.generation_tokens,
            hist_sum={k: v - before.hist_sum.get(k, 0.0) for k, v in self.hist_sum.items()},
            hist_count={k: v - before.hist_count.get(k, 0.0) for k, v in self.hist_count.items()},
        )

    def __add__(self, other: Snapshot) -> Snapshot:
        keys = set(self.accepted_per_pos) | set(other.accepted_per_pos)
        return Snapshot(
            drafts=self.drafts + other.drafts,
            draft_tokens=self.draft_tokens + other.draft_tokens,
            accepted=self.accepted + other.accepted,
            accepted_per_pos={
                p: self.accepted_per_pos.get(p, 0.0) + other.accepted_per_pos.get(p, 0.0)
                for p in keys
            },
            generation_tokens=self.generation_tokens + other.generation_tokens,
            hist_sum={
                k: self.hist_sum.get(k, 0.0) + other.hist_sum.get(k, 0.0) for k in HISTOGRAMS
            },
            hist_count={
                k: self.hist_count.get(k, 0.0) + other.hist_count.get(k, 0.0) for k in HISTOGRAMS
            },
        )

    def raw(self) -> dict:
        """The counters themselves (the report keeps them next to what is derived from them)."""
        return {
            "drafts": self.drafts,
            "draft_tokens": self.draft_tokens,
            "accepted": self.accepted,
            "accepted_per_pos": {str(p): v for p, v in sorted(self.accepted_per_pos.items())},
            "generation_tokens": self.generation_tokens,
            "hist_sum": dict(self.hist_sum),
            "hist_count": dict(self.hist_count),
        }

    def summary(self) -> dict:
        """Derived figures (None where the window has no drafts)."""
        d = self.drafts

        def mean(k: str) -> float | None:
            return (
                self.hist_sum.get(k, 0.0) / self.hist_count[k] if self.hist_count.get(k) else None
            )

        return {
            "acceptance_length": 1 + self.accepted / d if d else None,
            "acceptance_rate": self.accepted / self.draft_tokens if self.draft_tokens else None,
            "acceptance_per_position": [
                self.accepted_per_pos[p] / d for p in sorted(self.accepted_per_pos)
            ]
            if d
            else [],
            "server_mean_tpot_s": mean("tpot"),
            "server_mean_ttft_s": mean("ttft"),
        }


def snapshot(base_url: str, api_key: str | None = None, timeout_s: float = 30) -> Snapshot:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(f"{base_url}/metrics", headers=headers, timeout=timeout_s)
    r.raise_for_status()
    return Snapshot.from_text(r.text)
