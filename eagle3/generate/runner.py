"""The generate stage: every prompt through the served target, kept with its exact tokens.

    manifest = generate(cfg, base_urls, out_dir)

- A bounded in-flight window: at most ``concurrency`` requests (and coroutines) exist at any
  time, however many prompts there are; prompts are pulled lazily from the dataset.
- Reasoning is read from ``message.reasoning`` (vLLM >= 0.16), else ``reasoning_content``;
  a profile that expects reasoning flags samples that have none instead of losing it silently.
- Token ids come from the server (``return_token_ids``); rebuilt from the chat template only
  when a server gives none (recorded per sample as ``token_ids_source``).
- Exact resume: ids already in the shards are skipped; a torn last record is cut off.
- A prompt the server rejects is recorded and the run goes on; a server that stops answering
  stops the stage with a clear error after the retries (a rerun resumes). A wrong URL or key
  (404/401/403) stops it at once: it is the setup's fault, not the prompts' (issue #16).
- Every sample's prompt ids are checked against the local tokenizer and chat template before
  it is stored: ids that mean something else to extract and train stop the run, and nothing more
  is stored after the first failure. A rerun re-checks what earlier runs stored and drops what
  fails (requested again). Without a tokenizer the run says so, the manifest records it, and
  extract refuses the folder unless told to accept it (issue #30).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from eagle3.atomic import write_json_atomic
from eagle3.config import PipelineConfig
from eagle3.errors import NoResult, ServerUnavailable, disk_full, is_disk_full
from eagle3.generate.checks import TokenCheck, check_endpoints, recheck_folder, token_check_for
from eagle3.generate.client import (
    BadResponse,
    EndpointPool,
    Exhausted,
    Rejected,
    RetryPolicy,
    chat_request,
    endpoints_alive,
    make_pool,
)
from eagle3.generate.manifest import run_manifest
from eagle3.generate.prompts import Prompt, PromptStats, Skip, exclusion_keys, iter_prompts
from eagle3.generate.records import build_record
from eagle3.generate.storage import ShardStore
from eagle3.serving.readiness import root_url
from eagle3.signals import run_async

log = logging.getLogger(__name__)


@dataclass
class Progress:
    done: int = 0
    total: int | None = None
    failed: int = 0
    skipped: int = 0
    completion_tokens: int = 0
    started: float = 0.0

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / max(self.elapsed, 1e-9)

    @property
    def eta_s(self) -> float | None:
        if not self.total or not self.done:
            return None
        rate = self.done / max(self.elapsed, 1e-9)
        return max(self.total - self.done - self.failed - self.skipped, 0) / rate


async def _tokenize_count(
    base_url: str,
    model: str,
    messages: list[dict[str, str]],
    kwargs: dict[str, Any],
    api_key: str | None,
) -> tuple[int, int] | None:
    """(prompt tokens, max model len) from vLLM's /tokenize, or None if the server has no such
    endpoint."""
    try:
        async with httpx.AsyncClient(
            timeout=60, headers={"Authorization": f"Bearer {api_key}"} if api_key else {}
        ) as c:
            r = await c.post(
                f"{base_url}/tokenize",
                json={
                    "model": model,
                    "messages": messages,
                    "add_generation_prompt": True,
                    "chat_template_kwargs": kwargs,
                },
            )
        if r.status_code != 200:
            return None
        body = r.json()
        return int(body["count"]), int(body["max_model_len"])
    except (httpx.HTTPError, KeyError, ValueError):
        return None


class _GenerateRun:
    """One generate run into a folder: the endpoints, the shard store, the progress, and the
    requests that fill them (each prompt sent, its answer checked and saved)."""

    def __init__(
        self,
        cfg: PipelineConfig,
        pool: EndpointPool,
        store: ShardStore,
        progress: Progress,
        rebuild,
        on_progress,
        token_check: TokenCheck | None = None,
    ):
        self.cfg, self.pool, self.store, self.progress = cfg, pool, store, progress
        self.g = cfg.generate
        self.rebuild = rebuild
        self.token_check = token_check or TokenCheck(None, None, None)
        self.on_progress = on_progress
        self.policy = RetryPolicy(self.g.max_attempts, self.g.backoff_base_s, self.g.backoff_max_s)
        self.counts: Counter[str] = Counter()
        self.prompt_tokens = 0

    def request(self, prompt: Prompt, max_tokens: int) -> dict[str, Any]:
        """The chat completion body (vLLM's extra fields inline: it is sent as JSON as is)."""
        body: dict[str, Any] = {
            "model": self.cfg.target.served_model_name,
            "messages": prompt.messages,
            "max_tokens": max_tokens,
            "temperature": self.g.temperature,
            "top_p": self.g.top_p,
            "return_token_ids": True,
        }
        if self.g.chat_template_kwargs:
            body["chat_template_kwargs"] = self.g.chat_template_kwargs
        return body

    def error(
        self, kind: str, reason: str, prompt: Prompt | None = None, source: Any = None
    ) -> None:
        self.store.add_error(
            {
                "id": prompt.id if prompt else None,
                "source": prompt.source_index if prompt else source,
                "kind": kind,
                "reason": reason,
                "time": time.time(),
            }
        )
        self.counts[kind] += 1
        if kind == "failed":
            self.progress.failed += 1
        else:
            self.progress.skipped += 1

    async def one(self, prompt: Prompt) -> None:
        max_tokens = self.g.max_tokens
        for _ in range(2):  # a second try only with max_tokens cut to what the context leaves
            try:
                resp, ep, attempts, latency = await chat_request(
                    self.pool, self.request(prompt, max_tokens), self.policy
                )
            except Rejected as e:
                if e.status == 400 and self.g.length_check:
                    ep = self.pool.pick().base_url
                    counted = await _tokenize_count(
                        ep,
                        self.cfg.target.served_model_name,
                        prompt.messages,
                        self.g.chat_template_kwargs,
                        self.cfg.serve.api_key,
                    )
                    if counted:
                        n, limit = counted
                        if n >= limit:
                            return self.error(
                                "skipped",
                                f"prompt too long: {n} tokens >= max model len {limit}",
                                prompt,
                            )
                        if n + max_tokens > limit and max_tokens != limit - n:
                            max_tokens = limit - n
                            self.counts["max_tokens_reduced"] += 1
                            continue
                return self.error("rejected", str(e), prompt)
            except Exhausted as e:
                if not await endpoints_alive(self.pool, self.cfg.serve.api_key):
                    raise ServerUnavailable(
                        "no endpoint answers /health any more "
                        f"({', '.join(p.base_url for p in self.pool.endpoints)}); "
                        f"last error: {e}. {self.progress.done} samples were saved this run; "
                        "rerun to resume."
                    ) from None
                return self.error("failed", str(e), prompt)
            except BadResponse as e:
                return self.error("failed", str(e), prompt)
            try:
                record = build_record(
                    prompt,
                    resp,
                    ep,
                    attempts,
                    latency,
                    self.cfg.target.expects_reasoning,
                    self.rebuild,
                )
            except (KeyError, IndexError, TypeError) as e:
                return self.error("failed", f"malformed response: {type(e).__name__}: {e}", prompt)
            if not record["completion_token_ids"]:  # not a sample: nothing to train on (#39)
                self.counts["empty_completion"] += 1
                return self.error(
                    "failed",
                    "empty completion: the server returned no token (finish_reason "
                    f"{record['finish_reason']!r}, max_tokens {max_tokens}); requested again on a "
                    "rerun",
                    prompt,
                )
            self.token_check(record)
            self.store.add(record)
            self.counts["generated"] += 1
            for flag in record["flags"]:
                self.counts[flag] += 1
            self.progress.done += 1
            self.progress.completion_tokens += len(record["completion_token_ids"])
            self.prompt_tokens += len(record["prompt_token_ids"])
            return None

    async def run(self, items: Iterator[Prompt | Skip], window: int) -> None:
        pending: set[asyncio.Task] = set()
        last_report = 0.0
        try:
            for item in items:
                if isinstance(item, Skip):
                    self.error("skipped", item.reason, source=item.source_index)
                    continue
                if item.id in self.store.done_ids:
                    continue
                if item.id in self.store.permanent_ids and not self.g.retry_rejected:
                    self.counts["previously_rejected"] += 1
                    continue
                pending.add(asyncio.create_task(self.one(item)))
                if len(pending) >= window:
                    done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                    _raise_first(done)  # re-raise ServerUnavailable, TokenIdMismatch and bugs
                now = time.monotonic()
                if self.on_progress and now - last_report > 0.5:
                    self.on_progress(self.progress)
                    last_report = now
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                _raise_first(done)
                if self.on_progress:
                    self.on_progress(self.progress)
        finally:
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)


def _raise_first(done: set[asyncio.Task]) -> None:
    """Re-raise the first failure among finished tasks, after retrieving every one's exception.

    Why all of them: several requests fail together (a full disk, a server with other token ids)
    and a failure never retrieved is printed as "Task exception was never retrieved" with its
    traceback when the task is collected: 3 to 7 of them followed the one-line error (issue #30).
    """
    errors = [t.exception() for t in done if not t.cancelled() and t.exception() is not None]
    if errors:
        raise errors[0]


def load_prompts(cfg: PipelineConfig, stats: PromptStats) -> Iterator[Prompt | Skip]:
    g = cfg.generate
    return iter_prompts(
        g.dataset,
        split=g.split,
        data_format=g.data_format,
        prompt_column=g.prompt_column,
        messages_column=g.messages_column,
        turns=g.turns,
        num_samples=g.num_samples,
        seed=g.seed,
        exclude=exclusion_keys(g.exclude_files, mt_bench=g.exclude_mt_bench),
        stats=stats,
    )


def make_rebuilder(cfg: PipelineConfig, tok: Any | None):
    if tok is None:
        return None
    from eagle3.tokens import rebuild_token_ids

    t = cfg.target

    def rebuild(messages, reasoning, content, finish_reason):
        return rebuild_token_ids(
            tok,
            messages,
            reasoning,
            content,
            finish_reason,
            think_start_id=t.think_start_id,
            think_end_id=t.think_end_id,
            chat_template_kwargs=cfg.generate.chat_template_kwargs,
        )

    return rebuild


def generate(
    cfg: PipelineConfig,
    base_urls: list[str],
    out_dir: Path,
    *,
    concurrency: int | None = None,
    tokenizer_path: str | None = None,
    on_progress: Callable[[Progress], None] | None = None,
    finalize: bool = True,
    token_check: bool = True,
) -> dict[str, Any]:
    """Run (or resume) the generate stage into ``out_dir``; returns the manifest.

    ``tokenizer_path`` overrides where the checking tokenizer comes from (default:
    ``check_tokenizer_source``); ``token_check=False`` stores ids unchecked (recorded as such):
    only for stand-in servers whose canned ids are nobody's."""
    g = cfg.generate
    window = concurrency or (g.concurrency if isinstance(g.concurrency, int) else None)
    if window is None:
        raise ValueError(
            "generate.concurrency is 'auto': resolve it with profile_concurrency first"
        )
    out_dir = Path(out_dir)
    base_urls = [root_url(u) for u in base_urls]
    run_async(check_endpoints(base_urls, cfg.target.served_model_name, cfg.serve.api_key))
    store = ShardStore(out_dir, shard_size=g.shard_size)
    for where, reason in store.bad_lines:
        log.warning("%s: %s; skipped (that sample is requested again)", where, reason)
    repaired = _repair(store)
    resumed_from = len(store.done_ids)
    stats = PromptStats()
    progress = Progress(total=g.num_samples, started=time.monotonic())
    pool = make_pool(
        base_urls,
        api_key=cfg.serve.api_key,
        timeout_s=g.timeout_s,
        connect_timeout_s=g.connect_timeout_s,
        max_connections=window,
        strategy=g.balancing,
    )
    tok, check = token_check_for(cfg, tokenizer_path, token_check)
    runner = _GenerateRun(cfg, pool, store, progress, make_rebuilder(cfg, tok), on_progress, check)
    started = time.time()

    async def main() -> None:
        try:
            await runner.run(load_prompts(cfg, stats), window)
        finally:
            await pool.close()

    runner.counts.update(repaired)
    try:
        if dropped := recheck_folder(store, check):
            runner.counts["dropped_wrong_token_ids"] = dropped
        run_async(main())
        store.close()
        if not store.done_ids:
            raise NoResult(
                f"generate stored 0 samples in {out_dir} ({stats.rows} dataset rows read, this "
                f"run: {dict(runner.counts) or 'no request'}): nothing to train on, nothing "
                f"sealed. The reasons are in {out_dir / 'errors.jsonl'}; check generate.dataset "
                "and the server, then rerun"
            )
        if finalize:
            store.finalize()
        manifest = run_manifest(
            cfg, base_urls, window, stats, runner, resumed_from, time.time() - started, out_dir
        )
        write_json_atomic(out_dir / "manifest.json", manifest)
    except BaseException as e:
        _close_quietly(store)
        if is_disk_full(e):
            raise disk_full(
                out_dir,
                _bytes_still_needed(out_dir, len(store.done_ids), g.num_samples),
                "the remaining samples",
            ) from e
        raise
    return manifest


def _repair(store: ShardStore) -> dict[str, int]:
    """Drop what two writers at once (or an older version) left: duplicate records, records
    with no completion token (issue #39). Returns the counts for ``this_run.counts``."""
    duplicates, empty = store.repair()
    if duplicates or empty:
        log.warning(
            "%s: dropped %d duplicate records (two writers at once?) and %d records with no "
            "completion token; their samples are requested again where none is left",
            store.root,
            duplicates,
            empty,
        )
    counts = {"dropped_duplicates": duplicates, "dropped_empty_completions": empty}
    return {k: n for k, n in counts.items() if n}


def _close_quietly(store: ShardStore) -> None:
    """Flush what is stored after a failure; a second failure (the same full disk) must not hide
    the first."""
    try:
        store.close()
    except OSError as e:
        log.warning("closing %s after a failure: %s", store.root, e)


def _bytes_still_needed(out_dir: Path, done: int, total: int | None) -> float | None:
    """Stored bytes per sample so far times the samples still to come (None if unknown)."""
    stored = sum(p.stat().st_size for p in Path(out_dir).glob("samples-*.jsonl*"))
    if not done or not stored:
        return None
    per_sample = stored / done
    return per_sample * max((total or done) - done, 1) * 1.1


def read_manifest(out_dir: Path) -> dict[str, Any]:
    return json.loads((Path(out_dir) / "manifest.json").read_text())
