"""Checks that stop generate before bad data is stored (issues #16, #30).

- ``check_endpoints``: a wrong URL, key or model name fails at once, naming the URL, instead of
  being recorded as one rejection per prompt (a rerun after the fix then had nothing to redo).
- ``TokenCheck``: the server's prompt ids of every sample must be what the local tokenizer and
  chat template give; ids that mean something else to extract and train stop the run before that
  sample is stored. Checking only the first prompts (issue #30) let 24 of 40 wrong samples in at
  concurrency 32: they were in flight when the first check failed.
- ``check_tokenizer``: where that tokenizer comes from (``target.tokenizer``, the embedded model,
  else ``target.model``), or why there is none; a run without one says so and its manifest
  records it, so extract refuses the folder unless told to accept it.
- ``recheck_stored``: a rerun re-checks the samples an earlier run stored without this check
  (before the fix, or without a tokenizer) and drops those that fail, so they are requested again.
- ``require_checked_ids``: extract's refusal of a folder whose ids no run could check.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

import httpx

from eagle3.errors import EndpointError, TokenIdMismatch
from eagle3.generate.storage import ShardStore, iter_samples
from eagle3.serving.readiness import FATAL_PROBE_STATUS, auth_headers

log = logging.getLogger(__name__)

# The field a stored record gets once its prompt ids were checked: the fingerprint of the
# tokenizer + template that checked them, so a rerun with the same one need not check it again.
CHECKED_FIELD = "token_ids_checked"


async def check_endpoints(urls: list[str], model: str, api_key: str | None) -> None:
    """Fail at once on a wrong URL, key or model name (404/401/403 or the model not listed on
    /v1/models) instead of charging every prompt with it. Unreachable endpoints are left to the
    retries (a server may come back)."""
    async with httpx.AsyncClient(timeout=30, headers=auth_headers(api_key)) as c:
        for url in urls:
            try:
                r = await c.get(f"{url}/v1/models")
            except httpx.HTTPError:
                continue
            if r.status_code in FATAL_PROBE_STATUS:
                raise EndpointError(
                    f"{url}/v1/models answered {r.status_code}: check the URL (serve.base_url / "
                    "--base-url / generate.endpoints: the server's root, with or without /v1) and "
                    "serve.api_key, then rerun"
                )
            try:
                served = (
                    [d.get("id") for d in r.json().get("data", [])]
                    if r.status_code == 200
                    else None
                )
            except (ValueError, AttributeError):
                served = None
            if served is not None and model not in served:
                raise EndpointError(
                    f"{url}/v1/models does not list {model!r} (it serves {served}): set "
                    "target.served_model_name to the served name, then rerun"
                )


def check_tokenizer_source(cfg: Any) -> str:
    """Where the tokenizer that checks the server's ids comes from: ``target.tokenizer``, the
    embedded model's prepared folder (prepared now if it is not yet), else ``target.model`` (a
    local folder or a hub id). Why the model: a target that is not embedded (the Kimi profile)
    otherwise had no check at all (issue #30)."""
    t = cfg.target
    if t.tokenizer:
        return t.tokenizer
    if t.is_embedded:
        from eagle3.embedded import prepare_model

        return str(prepare_model(cfg.paths.cache_dir, t.embedded_name))
    return t.model


def load_check_tokenizer(source: str, trust_remote_code: bool) -> tuple[Any | None, str | None]:
    """(tokenizer, None), or (None, why no check is possible): a tokenizer that cannot be loaded
    here (a hub id without network or cache, a folder without tokenizer files)."""
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code), None
    except Exception as e:  # noqa: BLE001 - any failure means: no check, said loudly, recorded
        first = (str(e).strip().splitlines() or [""])[0][:200]
        return None, f"the tokenizer {source} cannot be loaded ({type(e).__name__}: {first})"


class TokenCheck:
    """Compare every sample's prompt ids with the local tokenizer + chat template.

    Why every sample: a server or proxy that returns other ids (another tokenizer, a stub, a
    template change) would otherwise be stored as training data and extracted without complaint;
    a sample of them missed what was in flight when the first check failed (issue #30). Cost: one
    chat-template render per sample, small next to the generation itself."""

    def __init__(
        self,
        tokenizer: Any | None,
        chat_template_kwargs: dict[str, Any] | None,
        source: str | None,
        unchecked: str | None = None,
    ):
        self.tok, self.kwargs, self.source = tokenizer, chat_template_kwargs, source
        self.unchecked = None if tokenizer is not None else (unchecked or "no tokenizer")
        self.fingerprint: str | None = None
        if tokenizer is not None:
            from eagle3.fingerprint import local_fingerprint

            self.fingerprint = local_fingerprint(tokenizer, chat_template_kwargs)
        self.checked = 0
        self.rechecked = 0  # stored samples of earlier runs checked at the start of this one
        self.failed: str | None = None  # the first failure: nothing more is stored in this run

    @property
    def active(self) -> bool:
        return self.tok is not None

    def mismatch(self, record: dict[str, Any]) -> str | None:
        """Why the record's prompt ids are not the local template's ids (None if they are)."""
        from eagle3.tokens import template_prompt_ids

        theirs = record.get("prompt_token_ids")
        if not isinstance(record.get("messages"), list) or not isinstance(theirs, list):
            return "the record has no messages or prompt ids to check"
        mine = template_prompt_ids(self.tok, record["messages"], self.kwargs)
        if mine == theirs:
            return None
        at = next(
            (i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs))
        )
        return (
            f"the server's prompt token ids for sample {record.get('id')} ({len(theirs)} ids) "
            f"differ from the local tokenizer {self.source} + chat template ({len(mine)} ids) "
            f"at position {at}"
        )

    def __call__(self, record: dict[str, Any]) -> None:
        """Check one record before it is stored; marks it checked, or raises TokenIdMismatch."""
        if self.failed:  # the samples still in flight: the same message, nothing stored
            raise TokenIdMismatch(self.failed)
        if self.tok is None:
            return
        why = self.mismatch(record)
        self.checked += 1
        if why:
            self.failed = (
                f"{why}: extract and train would read them with the wrong meaning. Serve the "
                "target's own tokenizer, or point target.tokenizer at the served model's; nothing "
                "of this sample was stored"
            )
            raise TokenIdMismatch(self.failed)
        record[CHECKED_FIELD] = self.fingerprint


def recheck_stored(records: Iterable[dict[str, Any]], check: TokenCheck) -> dict[str, str]:
    """Sample id -> why, for the stored records whose ids fail the check. Records this tokenizer
    and template already checked (their ``token_ids_checked`` fingerprint) are not checked again.
    """
    bad: dict[str, str] = {}
    if not check.active:
        return bad
    for r in records:
        if r.get(CHECKED_FIELD) == check.fingerprint:
            continue
        why = check.mismatch(r)
        check.rechecked += 1
        if why:
            bad[r["id"]] = why
    return bad


def token_check_for(cfg: Any, tokenizer_path: str | None, enabled: bool = True):
    """(tokenizer or None, its TokenCheck). The tokenizer also rebuilds ids a server did not
    return. Without one the check is impossible: said loudly here, recorded in the manifest."""
    source = tokenizer_path or check_tokenizer_source(cfg)
    tok, why = load_check_tokenizer(source, cfg.target.trust_remote_code)
    if not enabled:
        why = "the token id check was turned off by the caller"
    if tok is None or not enabled:
        log.warning(
            "WARNING: the server's token ids cannot be checked (%s). Samples are stored "
            "UNCHECKED: the manifest records it and extract refuses this folder unless "
            "extract.accept_unchecked_token_ids=true. Set target.tokenizer to the served model's "
            "tokenizer to check them (a rerun then re-checks what is stored).",
            why,
        )
    return tok, TokenCheck(
        tok if enabled else None, cfg.generate.chat_template_kwargs, source, unchecked=why
    )


def recheck_folder(store: ShardStore, check: TokenCheck) -> int:
    """Re-check what earlier runs stored (before every sample was checked, or without a
    tokenizer) and drop the samples whose ids fail: they are recorded and requested again.
    Returns how many were dropped."""
    bad = recheck_stored(iter_samples(store.root, on_bad=lambda *_: None), check)
    if not bad:
        return 0
    store.drop(set(bad))
    for sid, why in bad.items():
        store.add_error(
            {
                "id": sid,
                "source": None,
                "kind": "failed",
                "reason": f"{why}: dropped from the folder, requested again",
                "time": time.time(),
            }
        )
    log.warning(
        "%s: %d stored samples had token ids that are not the local tokenizer's (%s); dropped, "
        "they are requested again",
        store.root,
        len(bad),
        check.source,
    )
    return len(bad)


def require_checked_ids(generate_dir: Any, gen_manifest: dict[str, Any], accept: bool) -> None:
    """Refuse a generate folder whose token ids generate could not check (its manifest says how
    many and why), unless ``accept`` (``extract.accept_unchecked_token_ids``). Why: ids of
    another tokenizer were extracted and trained on without a word (issue #30). Folders from
    before the check have no ``token_check`` and pass as before."""
    tc = gen_manifest.get("token_check") or {}
    n = tc.get("unchecked_samples") or 0
    if n and not accept:
        raise TokenIdMismatch(
            f"{generate_dir}: the token ids of {n} samples were not checked against the target's "
            f"tokenizer ({tc.get('unchecked')}); ids of another tokenizer would be trained on "
            "silently. Rerun generate into that folder where the tokenizer loads "
            "(target.tokenizer; it re-checks what is stored and requests what fails), or set "
            "extract.accept_unchecked_token_ids=true to use them as they are"
        )
