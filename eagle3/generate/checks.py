"""Checks that stop generate before bad data is stored (issue #16).

- ``check_endpoints``: a wrong URL, key or model name fails at once, naming the URL, instead of
  being recorded as one rejection per prompt (a rerun after the fix then had nothing to redo).
- ``TokenCheck``: the server's prompt ids for a sample of prompts must be what the local tokenizer
  and chat template give; ids that mean something else to extract and train stop the run.
"""

from __future__ import annotations

from typing import Any

import httpx

from eagle3.errors import EndpointError, TokenIdMismatch
from eagle3.serving.readiness import FATAL_PROBE_STATUS, auth_headers

TOKEN_CHECK_FIRST = (
    8  # the first prompts of every run whose ids are checked against the local template
)
TOKEN_CHECK_EVERY = 500  # and one in this many after them


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


class TokenCheck:
    """Compare a sample of the server's prompt ids with the local tokenizer + chat template.

    Why: a server or proxy that returns other ids (another tokenizer, a stub, a template change)
    would otherwise be stored as training data and extracted without complaint (issue #16)."""

    def __init__(
        self, tokenizer: Any | None, chat_template_kwargs: dict[str, Any] | None, source: str | None
    ):
        self.tok, self.kwargs, self.source = tokenizer, chat_template_kwargs, source
        self.seen = 0
        self.checked = 0

    def __call__(self, record: dict[str, Any]) -> None:
        if self.tok is None or record["token_ids_source"] != "server":
            return
        self.seen += 1
        if self.seen > TOKEN_CHECK_FIRST and self.seen % TOKEN_CHECK_EVERY:
            return
        from eagle3.tokens import template_prompt_ids

        mine = template_prompt_ids(self.tok, record["messages"], self.kwargs)
        self.checked += 1
        if mine != record["prompt_token_ids"]:
            at = next(
                (i for i, (a, b) in enumerate(zip(mine, record["prompt_token_ids"])) if a != b),
                min(len(mine), len(record["prompt_token_ids"])),
            )
            raise TokenIdMismatch(
                f"the server's prompt token ids for sample {record['id']} "
                f"({len(record['prompt_token_ids'])} ids) "
                f"differ from the local tokenizer {self.source} + chat template ({len(mine)} ids) "
                f"at position {at}: "
                "extract and train would read them with the wrong meaning. "
                "Serve the target's own tokenizer, or "
                "point target.tokenizer at the served model's; nothing of this sample was stored"
            )
