"""The vLLM backend of the extract stage: the target's hidden states, computed by the server itself.

Why through vLLM: for a target that only fits on the serving GPUs (Kimi-K2.5, 8 GPUs, INT4), the
server is the only thing that can run it; and its numerics are the ones the draft will see at
inference time. The pipeline still never imports vllm: it starts the server (serve stage) with
vLLM's ``extract_hidden_states`` speculative method and our connector
(``eagle3/extract/vllm_connector.py``, loaded inside the server), sends each sample's exact token
ids as a completion prompt (``max_tokens=1``), and reads the per-request safetensors file the
connector writes to a folder both sides see.

Layer ids use vLLM's convention: k = the input of decoder layer k = HF ``output_hidden_states[k]``;
k = num_hidden_layers is the last layer's output before the final norm (the "final" state).
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, wait
from pathlib import Path
from typing import Any

import httpx
import torch
from safetensors.torch import load_file

from eagle3 import PROJECT_ROOT
from eagle3.config import PipelineConfig
from eagle3.serving.gpus import release_gpus
from eagle3.serving.readiness import auth_headers
from eagle3.serving.server import Server, start_server

CONNECTOR_CLASS = "Eagle3HiddenStatesConnector"
CONNECTOR_MODULE = "eagle3.extract.vllm_connector"


class ExtractError(RuntimeError):
    """A sample's hidden states could not be obtained or do not match what was sent."""


def speculative_config(layer_ids: list[int]) -> dict[str, Any]:
    """vLLM's capture-only "drafter"; the layers go in the draft hf_config (sorted, unique: vLLM
    sorts them)."""
    return {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,  # the only value the extract proposer accepts
        "draft_model_config": {
            "hf_config": {"eagle_aux_hidden_state_layer_ids": sorted(set(layer_ids))}
        },
    }


def kv_transfer_config(storage_dir: Path) -> dict[str, Any]:
    return {
        "kv_connector": CONNECTOR_CLASS,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(storage_dir)},
    }


def extract_server_config(cfg: PipelineConfig, storage_dir: Path) -> PipelineConfig:
    """The profile's serve settings plus the connector, no prefix caching, and our root on
    PYTHONPATH.

    Prefix caching must be off: a cached prefix is not recomputed, so its hidden states would be
    missing (or stale) for the request. The server is always a child process of the extract stage:
    with ``serve.backend: systemd`` (production) the unit serves without the connector, so extract
    runs the same vLLM command (same vllm binary, tensor parallelism, lengths, parsers) itself, on a
    free port, once the unit has released the GPUs (:mod:`eagle3.serving.gpus`).
    """
    s = cfg.serve
    if s.backend == "external":
        raise ValueError(
            "extract backend 'vllm' starts its own vLLM server with a KV connector, "
            "which an external server "
            "(serve.backend=external) does not have: use extract.backend=hf, "
            "or run the pipeline with "
            "serve.backend process or systemd on the machine with the GPUs"
        )
    extra = list(s.extra_args) + [
        "--kv-transfer-config",
        json.dumps(kv_transfer_config(storage_dir), separators=(",", ":")),
        "--no-enable-prefix-caching",
    ]
    inherited = s.env.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    env = {**s.env, "PYTHONPATH": os.pathsep.join(p for p in (str(PROJECT_ROOT), inherited) if p)}
    update: dict[str, Any] = {"extra_args": extra, "env": env, "backend": "process"}
    if s.backend == "systemd":
        update["port"] = 0  # the unit's port is its own
    return cfg.model_copy(update={"serve": s.model_copy(update=update)})


async def _request(
    client: httpx.AsyncClient,
    server: Server,
    sample_id: str,
    token_ids: list[int],
    file_timeout_s: float,
) -> Path:
    """Send one exact-token prompt; return the path of the finished hidden-states file."""
    body = {"model": server.model, "prompt": token_ids, "max_tokens": 1, "temperature": 0.0}
    r = await client.post(f"{server.base_url}/v1/completions", json=body)
    if r.status_code != 200:
        raise ExtractError(f"sample {sample_id}: server answered {r.status_code}: {r.text[:500]}")
    params = r.json().get("kv_transfer_params") or {}
    if "hidden_states_path" not in params:
        raise ExtractError(
            f"sample {sample_id}: no kv_transfer_params.hidden_states_path in the response "
            "(is the connector configured?)"
        )
    path = Path(params["hidden_states_path"])
    deadline = time.monotonic() + file_timeout_s
    delay = 0.005
    while (
        not path.exists()
    ):  # the connector writes after the response is sent, then renames atomically
        if time.monotonic() > deadline:
            raise ExtractError(
                f"sample {sample_id}: {path} did not appear within {file_timeout_s} s"
            )
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.2)
    return path


def read_hidden(path: Path, sample_id: str, token_ids: list[int], pick: list[int]) -> torch.Tensor:
    """Load, check the tokens, reorder layers to the caller's order, delete the file."""
    data = load_file(str(path))
    path.unlink()
    got = data["token_ids"].tolist()
    if got != list(token_ids):
        raise ExtractError(
            f"sample {sample_id}: the server saw {len(got)} tokens that differ from the "
            f"{len(token_ids)} sent"
        )
    hidden = data["hidden_states"]
    if hidden.shape[0] != len(token_ids) or hidden.shape[1] < max(pick) + 1:
        raise ExtractError(
            f"sample {sample_id}: hidden_states {tuple(hidden.shape)} for {len(token_ids)} tokens"
        )
    return hidden[:, pick].float()


class StateServer:
    """The target's vLLM extract server and an async client for it, usable from any thread.

    ``submit(sample_id, token_ids)`` sends one exact-token prompt (at most ``concurrency`` in
    flight; the rest wait their turn) and returns a future of ``hidden [T, len(layer_ids), H]``
    float32; requests run on an event loop in a thread of their own, so a caller can keep the
    server busy with the next batches while it trains on this one (the online states,
    eagle3/train/online.py). Per-request files live in ``work_dir/vllm-hidden`` and are deleted
    once read. A context manager: the server stops at exit, on error too.
    """

    def __init__(
        self,
        cfg: PipelineConfig,
        model: str,
        layer_ids: list[int],
        work_dir: Path,
        concurrency: int = 8,
        request_timeout_s: float = 600.0,
        file_timeout_s: float = 120.0,
        attach: Server | None = None,
    ):
        """``attach``: a server another process started with the same ``work_dir`` (the
        training ranks of one online run share rank 0's): requests only, never stopped here."""
        if not layer_ids:
            raise ValueError("layer_ids is empty")
        captured = sorted(set(layer_ids))
        self.pick = [captured.index(k) for k in layer_ids]
        self.file_timeout_s = file_timeout_s
        self.storage = Path(work_dir) / "vllm-hidden"
        self.storage.mkdir(parents=True, exist_ok=True)
        if attach is not None:
            self.server = attach
        else:
            release_gpus(cfg, "extract")  # a production unit would hold the GPUs it needs
            self.server = start_server(
                extract_server_config(cfg, self.storage),
                model,
                log_dir=Path(work_dir) / "serve",
                speculative_config=speculative_config(captured),
            )
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="eagle3-vllm-states", daemon=True
        )
        self._thread.start()
        self._slots = asyncio.Semaphore(concurrency)
        #: requests at the server now, and the most at once: a source that keeps the server
        #: busy has more than one in flight (the online states' report)
        self.in_flight = self.max_in_flight = 0
        self._client = httpx.AsyncClient(
            headers=auth_headers(self.server.api_key),
            timeout=httpx.Timeout(request_timeout_s, connect=30.0),
            limits=httpx.Limits(max_connections=concurrency),
        )

    async def _one(self, sample_id: str, token_ids: list[int]) -> torch.Tensor:
        async with self._slots:
            self.in_flight += 1  # the event loop's thread only: no lock needed
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                path = await _request(
                    self._client, self.server, sample_id, token_ids, self.file_timeout_s
                )
            finally:
                self.in_flight -= 1
        return await asyncio.to_thread(read_hidden, path, sample_id, token_ids, self.pick)

    def submit(self, sample_id: str, token_ids: list[int]) -> Future[torch.Tensor]:
        return asyncio.run_coroutine_threadsafe(self._one(sample_id, list(token_ids)), self._loop)

    def close(self) -> None:
        """Cancel what is in flight, close the client, stop the server."""
        try:

            async def _shutdown() -> None:
                tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                await self._client.aclose()

            asyncio.run_coroutine_threadsafe(_shutdown(), self._loop).result(timeout=60)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        finally:
            self.server.stop()

    def __enter__(self) -> StateServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def extract_vllm(
    cfg: PipelineConfig,
    model: str,
    samples: Iterable[tuple[str, list[int]]],
    layer_ids: list[int],
    work_dir: Path,
    concurrency: int = 8,
    request_timeout_s: float = 600.0,
    file_timeout_s: float = 120.0,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(sample_id, hidden [T, len(layer_ids), H] float32)`` per sample, in completion order.

    Starts the target's vLLM server (process backend) for the duration of the iteration and stops
    it at the end, on error, or when the consumer stops iterating. ``samples`` is read lazily,
    ``concurrency`` requests at a time (:class:`StateServer`).
    """
    with StateServer(
        cfg, model, layer_ids, work_dir, concurrency, request_timeout_s, file_timeout_s
    ) as states:
        pending: dict[Future, str] = {}
        it = iter(samples)
        exhausted = False
        while True:
            while not exhausted and len(pending) < concurrency:
                try:
                    sample_id, token_ids = next(it)
                except StopIteration:
                    exhausted = True
                    break
                pending[states.submit(sample_id, token_ids)] = sample_id
            if not pending:
                break
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for fut in done:
                yield pending.pop(fut), fut.result()
