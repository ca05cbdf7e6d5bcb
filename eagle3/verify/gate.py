"""The gate, and promotion of a draft that passes it.

Promoted drafts of a profile live in ``<runs_dir>/promoted/<profile>/``::

    drafts/<UTC time>-<key>/     a copy of the exported draft (config.json, model.safetensors)
    latest -> drafts/...         symlink, replaced atomically
    latest.json                  what was promoted: acceptance length, workload, k, report path
    history.jsonl                one line per promotion

"Not worse than the last promoted draft" compares acceptance lengths only on the same workload,
temperature and max_tokens, and at one k both drafts were served at (a k sweep records vLLM's
acceptance length at every k it served, ``acceptance_by_k``; the last draft's own k first, so a
sweep that moves the best k still compares); otherwise the comparison is reported as not
applicable (an acceptance length on another workload or at another k says nothing).

``verify.require_beat_ngram`` adds: the draft's acceptance length and its speedup at the lowest
concurrency must both exceed the n-gram (prompt lookup) baseline's, measured on the same workload.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from eagle3.atomic import replace_symlink, write_json_atomic


class GateFailed(RuntimeError):
    """The draft did not pass the verify gate; it was not promoted."""


@dataclass
class GateResult:
    passed: bool
    reasons: list[str] = field(default_factory=list)
    checks: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def promoted_dir(runs_dir: Path, profile: str) -> Path:
    return Path(runs_dir) / "promoted" / profile


def last_promoted(runs_dir: Path, profile: str) -> dict[str, Any] | None:
    p = promoted_dir(runs_dir, profile) / "latest.json"
    return json.loads(p.read_text()) if p.is_file() else None


def _by_k(rec: dict[str, Any], acceptance_length: float | None) -> dict[int, float]:
    """{k: vLLM acceptance length} of a draft: every k it was served at (a record from before
    ``acceptance_by_k``: its one k)."""
    by_k = {int(k): a for k, a in (rec.get("acceptance_by_k") or {}).items() if a is not None}
    k = rec.get("num_speculative_tokens")
    if acceptance_length is not None and k is not None:
        by_k.setdefault(int(k), acceptance_length)
    return by_k


def common_k(
    prev: dict[str, Any], cur: dict[str, Any], acceptance_length: float | None
) -> tuple[int, float, float] | None:
    """(k, previous acceptance length, current one) to compare the two drafts at, or None.

    Same workload, temperature and max_tokens; at the last draft's k if this one was served at
    it, else at this draft's k if the last one was, else the largest k both were."""
    keys = ("workload_fingerprint", "temperature", "max_tokens")
    if any(prev.get(k) != cur.get(k) for k in keys):
        return None
    a, b = _by_k(prev, prev.get("acceptance_length")), _by_k(cur, acceptance_length)
    both = set(a) & set(b)
    if not both:
        return None
    order = [prev.get("num_speculative_tokens"), cur.get("num_speculative_tokens")]
    k = next((k for k in order if k in both), max(both))
    return k, a[k], b[k]


def beat_ngram_reasons(versus: dict[str, Any] | None, ngram_reason: str | None = None) -> list[str]:
    """Why the draft does not beat the n-gram baseline (``runner.versus_ngram``'s dict); [] if it
    does.

    Both must exceed the baseline's: the acceptance length (against vLLM's own n-gram figure,
    counted over the steps where n-gram proposed: the stricter one) and the speedup at the lowest
    concurrency."""
    if versus is None:
        return [
            f"verify.require_beat_ngram: the n-gram baseline was not measured "
            f"({ngram_reason or 'unknown'})"
        ]
    reasons = []
    d, n, c = versus["draft"], versus["ngram"], versus["concurrency"]
    dal, nal = d["acceptance_length"], n["acceptance_length"]
    if dal is None or dal <= nal:
        reasons.append(
            f"acceptance length {'-' if dal is None else f'{dal:.3f}'} does not exceed the n-gram "
            f"baseline's {nal:.3f} (vLLM's count over the steps where n-gram proposed; "
            f"{_fmt(n.get('acceptance_length_all_steps'))} over all steps)"
        )
    ds, ns = d["speedup"], n["speedup"]
    if ds is None or ns is None or ds <= ns:
        reasons.append(
            f"speedup at concurrency {c} x{_fmt(ds)} "
            f"does not exceed the n-gram baseline's x{_fmt(ns)}"
        )
    return reasons


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def evaluate_gate(
    acceptance_length: float | None,
    conditions: dict[str, Any],
    prev: dict[str, Any] | None,
    *,
    min_acceptance_length: float,
    max_regression: float,
    mismatch_fraction: float | None = None,
    max_mismatch_fraction: float | None = None,
    require_beat_ngram: bool = False,
    versus_ngram: dict[str, Any] | None = None,
    ngram_reason: str | None = None,
) -> GateResult:
    reasons: list[str] = []
    checks: dict[str, Any] = {
        "min_acceptance_length": min_acceptance_length,
        "max_regression": max_regression,
    }
    if acceptance_length is None:
        reasons.append(
            "no speculative drafts were counted (vllm:spec_decode_num_drafts did not move): "
            "is speculative decoding on?"
        )
    elif acceptance_length < min_acceptance_length:
        reasons.append(
            f"acceptance length {acceptance_length:.3f} < minimum {min_acceptance_length}"
        )
    same = None if prev is None else common_k(prev, conditions, acceptance_length)
    if same is not None:
        k, before, now = same
        floor = before * (1 - max_regression)
        checks["previous"] = {
            "num_speculative_tokens": k,
            "acceptance_length": before,
            "this_draft": now,
            "draft": prev.get("draft"),
            "floor": floor,
        }
        if now < floor:
            reasons.append(
                f"acceptance length {now:.3f} at k={k} is more than {max_regression:.0%} below "
                f"the last promoted draft's {before:.3f} at k={k} ({prev.get('draft')})"
            )
    else:
        checks["previous"] = (
            None
            if prev is None
            else "not comparable (other workload, temperature or max_tokens, or no k both "
            "were served at)"
        )
    if max_mismatch_fraction is not None and mismatch_fraction is not None:
        checks["max_mismatch_fraction"] = max_mismatch_fraction
        if mismatch_fraction > max_mismatch_fraction:
            reasons.append(
                f"{mismatch_fraction:.1%} of greedy outputs differ from the baseline "
                f"(allowed {max_mismatch_fraction:.1%})"
            )
    checks["require_beat_ngram"] = require_beat_ngram
    if versus_ngram is not None or require_beat_ngram:
        not_beaten = beat_ngram_reasons(versus_ngram, ngram_reason)
        checks["beats_ngram"] = None if versus_ngram is None else not not_beaten
        if require_beat_ngram:
            reasons += not_beaten
    return GateResult(not reasons, reasons, checks)


def promote(draft_dir: Path, runs_dir: Path, profile: str, record: dict[str, Any]) -> Path:
    """Copy ``draft_dir`` under promoted/<profile>/drafts/ and point ``latest`` at it
    (atomically)."""
    root = promoted_dir(runs_dir, profile)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    dest = root / "drafts" / f"{stamp}-{record.get('key', 'draft')}"
    tmp = dest.with_name(f".{dest.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(draft_dir, tmp)
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    replace_symlink(root / "latest", Path("drafts") / dest.name)
    entry = {**record, "draft": str(dest), "source": str(draft_dir), "promoted_at": stamp}
    write_json_atomic(root / "latest.json", entry)
    with open(root / "history.jsonl", "a") as f:
        f.write(json.dumps(entry) + "\n")
    return dest
