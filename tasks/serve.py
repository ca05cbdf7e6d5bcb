"""Prefect tasks for the serve stage: start (and later stop) the target's vLLM server.

The server outlives the task that starts it (generate, extract and verify use it), so the
flow owns its lifetime: it calls ``stop_server_task`` in a ``finally`` block. Nothing here
is cached: a server is a process, not an artifact.
"""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from eagle3.config import PipelineConfig
from eagle3.serving.client import ChatResult, chat
from eagle3.serving.server import Server, start_server


@task(name="serve", retries=1, retry_delay_seconds=10, cache_policy=NO_CACHE, persist_result=False)
def start_server_task(cfg: PipelineConfig, model: str) -> Server:
    logger = get_run_logger()
    logger.info("starting %s server for %s", cfg.serve.backend, model)
    server = start_server(cfg, model)
    logger.info("ready in %.1f s at %s", server.ready_s, server.base_url)
    create_markdown_artifact(
        key="serve",
        markdown="| field | value |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in server.info().items()),
        description="vLLM server of this run",
    )
    return server


@task(name="stop-server", cache_policy=NO_CACHE, persist_result=False)
def stop_server_task(server: Server) -> None:
    server.stop()


@task(name="smoke-chat", retries=2, retry_delay_seconds=5, cache_policy=NO_CACHE, persist_result=False)
def smoke_chat_task(server: Server, prompt: str) -> ChatResult:
    """One chat request with exact token ids: the served model really answers."""
    result = chat(server.base_url, server.model, prompt, api_key=server.api_key)
    if not result.completion_token_ids:
        raise RuntimeError("server answered without token ids: is this vLLM with return_token_ids support?")
    get_run_logger().info("answer: %r (%d tokens)", result.content, len(result.completion_token_ids))
    return result
