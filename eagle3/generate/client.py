"""One chat request per prompt, with our own retry policy, over one or several endpoints.

Why our own retries: the OpenAI client's built-in ones (2 by default) neither add jitter
for 128-200 concurrent callers nor tell us what failed; and its default timeout (600 s)
killed long reasoning in the seed run. Here: explicit timeouts, exponential backoff with
full jitter on 429 / 5xx / timeouts / connection errors, and a clear split between
retryable failures and a prompt the server rejects (400: recorded, never retried).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai

try:  # the transport openai's client is built on: httpx2 (openai 3.x), which since 2.17 rejects
    import httpx2 as transport  # httpx's Timeout; httpx before that
except ImportError:  # pragma: no cover
    import httpx as transport
from openai import AsyncOpenAI, DefaultAioHttpClient

from eagle3.errors import EndpointError
from eagle3.serving.readiness import auth_headers, root_url

RETRYABLE_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}
# A wrong path, a wrong model name or a wrong key: the same for every prompt, so it stops the run
# (naming the URL) instead of being recorded as one rejection per sample.
SETUP_STATUS = {401, 403, 404}


class Rejected(Exception):
    """The server refused this prompt (4xx): a property of the sample, not of the server."""

    def __init__(self, status: int, message: str):
        super().__init__(f"rejected by server ({status}): {message}")
        self.status = status


class Exhausted(Exception):
    """Retryable failures until ``max_attempts`` ran out."""


class BadResponse(Exception):
    """A 200 whose body is not a JSON object: recorded as a failure of this sample (retried on
    rerun)."""


@dataclass
class RetryPolicy:
    max_attempts: int = 5
    base_s: float = 1.0
    max_s: float = 60.0

    def delay(self, attempt: int) -> float:
        """Full jitter: uniform(0, min(max, base * 2^attempt))."""
        return random.uniform(0, min(self.max_s, self.base_s * (2**attempt)))


@dataclass
class Endpoint:
    base_url: str
    client: AsyncOpenAI
    in_flight: int = 0
    sent: int = 0
    failures: int = 0


@dataclass
class EndpointPool:
    """Spread requests over endpoints: ``least_loaded`` (fewest in flight) or ``round_robin``."""

    endpoints: list[Endpoint]
    strategy: str = "least_loaded"
    _rr: Any = field(default=None, repr=False)

    def pick(self) -> Endpoint:
        if self.strategy == "round_robin":
            if self._rr is None:
                self._rr = itertools.cycle(self.endpoints)
            return next(self._rr)
        return min(self.endpoints, key=lambda e: e.in_flight)

    async def close(self) -> None:
        for e in self.endpoints:
            await e.client.close()


async def endpoints_alive(
    pool: EndpointPool,
    api_key: str | None,
    timeout_s: float = 10.0,
    tries: int = 4,
    wait_s: float = 5.0,
) -> bool:
    """Whether any endpoint still answers ``/health`` (asked once a prompt has used up its
    retries: a dead server stops the run, a bad prompt does not). A refused connection or an
    error status means that server is gone; a timeout is a live server too busy to answer (on a
    loaded 2-core machine a healthy vLLM missed the 10 s and the run was stopped wrongly), so a
    round in which an endpoint timed out is asked again after ``wait_s``: ``tries`` rounds."""
    async with httpx.AsyncClient(timeout=timeout_s, headers=auth_headers(api_key)) as c:
        for round_ in range(tries):
            busy = False
            for ep in pool.endpoints:
                try:
                    if (await c.get(f"{root_url(ep.base_url)}/health")).status_code == 200:
                        return True
                except httpx.TimeoutException:
                    busy = True
                except httpx.HTTPError:
                    continue
            if not busy:
                return False
            if round_ + 1 < tries:
                await asyncio.sleep(wait_s)
    return False


def make_pool(
    base_urls: list[str],
    *,
    api_key: str | None,
    timeout_s: float,
    connect_timeout_s: float,
    max_connections: int,
    strategy: str = "least_loaded",
) -> EndpointPool:
    endpoints = []
    for url in base_urls:
        # aiohttp transport: httpx's own async transport tops out near 300 req/s on one core here,
        # aiohttp gives the client >1000 req/s (bench/generate_throughput.py).
        http = DefaultAioHttpClient(
            timeout=transport.Timeout(timeout_s, connect=connect_timeout_s),
            limits=transport.Limits(
                max_connections=max_connections, max_keepalive_connections=max_connections
            ),
        )
        url = root_url(url)
        client = AsyncOpenAI(
            base_url=f"{url}/v1",
            api_key=api_key or "EMPTY",
            max_retries=0,
            timeout=transport.Timeout(timeout_s, connect=connect_timeout_s),
            http_client=http,
        )
        endpoints.append(Endpoint(url, client))
    return EndpointPool(endpoints, strategy)


def _error_text(e: openai.APIStatusError) -> str:
    try:
        body = e.response.json()
        msg = (
            body.get("error", {}).get("message")
            if isinstance(body.get("error"), dict)
            else body.get("message")
        )
        return str(msg or body)[:500]
    except ValueError:
        return e.response.text[:500]


async def chat_request(
    pool: EndpointPool,
    request: dict[str, Any],
    policy: RetryPolicy,
) -> tuple[dict[str, Any], str, int, float]:
    """POST one chat completion body with retries. Returns (response JSON, endpoint, attempts,
    latency of the last try).

    The raw JSON is kept (not the SDK's pydantic object): vLLM's extra fields
    (``prompt_token_ids``, ``token_ids``, ``reasoning``) are read as sent, and a million
    responses are not each parsed twice.
    """
    last: Exception | None = None
    for attempt in range(policy.max_attempts):
        ep = pool.pick()
        ep.in_flight += 1
        ep.sent += 1
        t0 = time.perf_counter()
        try:
            # The generic post skips the SDK's typed-params transform (a recursive walk of every
            # message: a third of the CPU time per request at high rates) but keeps its auth,
            # timeouts and error mapping.
            raw = await ep.client.post(
                "/chat/completions", body=request, cast_to=transport.Response
            )
            try:
                body = json.loads(raw.content)
            except ValueError as e:
                raise BadResponse(
                    f"{ep.base_url}/v1/chat/completions answered {raw.status_code} "
                    "with a body that is "
                    f"not JSON ({e}): {raw.content[:120]!r}"
                ) from None
            if not isinstance(body, dict):
                raise BadResponse(
                    f"{ep.base_url}/v1/chat/completions answered a JSON {type(body).__name__}, "
                    "not an object"
                )
            return body, ep.base_url, attempt + 1, time.perf_counter() - t0
        except openai.APIStatusError as e:
            if e.status_code in SETUP_STATUS:
                raise EndpointError(
                    f"{ep.base_url}/v1/chat/completions answered {e.status_code} "
                    f"({_error_text(e)[:200]}): check the "
                    "URL (serve.base_url / --base-url / generate.endpoints: the server's root, "
                    "with or without /v1), "
                    "target.served_model_name and serve.api_key; "
                    "nothing was charged to the prompts, rerun after fixing"
                ) from None
            if e.status_code not in RETRYABLE_STATUS:
                raise Rejected(e.status_code, _error_text(e)) from None
            last = e
        except (openai.APITimeoutError, openai.APIConnectionError) as e:
            last = e
        finally:
            ep.in_flight -= 1
        ep.failures += 1
        if attempt + 1 < policy.max_attempts:
            await asyncio.sleep(policy.delay(attempt))
    # The aiohttp transport reports a refused connection as a timeout; the cause says which it was.
    cause = f" ({last.__cause__})" if last is not None and last.__cause__ else ""
    raise Exhausted(f"{type(last).__name__} after {policy.max_attempts} attempts: {last}{cause}")
