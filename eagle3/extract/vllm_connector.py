"""A device-agnostic vLLM KV connector that writes the target's hidden states to disk.

Imported INSIDE the vLLM server process (``kv_connector_module_path =
"eagle3.extract.vllm_connector"``, the project root on the server's PYTHONPATH), whose venv has
none of the pipeline's dependencies: this module imports only the stdlib, torch, safetensors and
vllm. ``eagle3/__init__.py`` imports only pathlib, so importing the package there is safe.

What vLLM (0.32) does that this connector relies on (layer ids, the final state, ordering,
prompt tokens only, prefix caching off, the output file) is in docs/extract.md, "How vLLM
captures hidden states".
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file
from vllm.config import VllmConfig, get_layers_from_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
from vllm.logger import init_logger
from vllm.utils.gpu_sync_debug import gpu_sync_allowed
from vllm.v1.attention.backend import AttentionMetadata
from vllm.v1.core.sched.output import SchedulerOutput

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger(f"vllm.{__name__}")  # under "vllm" so that vLLM's log config shows it


@dataclass
class PendingSave:
    req_id: str
    filename: str
    token_ids: torch.Tensor  # [T] int64, CPU
    block_ids: list[int]


@dataclass
class Eagle3HiddenStatesMetadata(KVConnectorMetadata):
    """Scheduler -> worker: the requests whose hidden states are to be written this step."""

    pending_saves: list[PendingSave] = field(default_factory=list)


def gather_blocks(cache: torch.Tensor, block_ids: list[int], num_tokens: int) -> torch.Tensor:
    """Rows of a [num_blocks, num_layers, block_size, H] buffer for one request ->
    [T, num_layers, H].

    Same slot arithmetic as CacheOnlyAttentionLayer's writer (``basic_cache``).
    """
    block_size = cache.shape[2]
    blocks = torch.tensor(block_ids, dtype=torch.long)
    slots = (blocks[:, None] * block_size + torch.arange(block_size)[None, :]).flatten()[
        :num_tokens
    ]
    slots = slots.to(cache.device)
    return cache[slots // block_size, :, slots % block_size]


def write_atomic(tensors: dict[str, torch.Tensor], filename: str) -> None:
    """Write to ``filename.tmp`` then rename: readers never see a partial file."""
    tmp = filename + ".tmp"
    save_file(tensors, tmp)
    os.replace(tmp, filename)


class Eagle3HiddenStatesConnector(KVConnectorBase_V1, SupportsHMA):
    """Store-only connector: on request finish, write its hidden states to one safetensors file.

    Use with ``speculative_config.method = "extract_hidden_states"``, ``kv_role = "kv_producer"``,
    ``kv_connector_extra_config = {"shared_storage_path": DIR}`` (optional ``num_writer_threads``).
    """

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        spec = vllm_config.speculative_config
        if spec is None or spec.method != "extract_hidden_states":
            raise ValueError(
                "Eagle3HiddenStatesConnector needs "
                "speculative_config.method='extract_hidden_states'"
            )
        self._group_id = self._hidden_state_group(kv_cache_config)
        self._storage_path = str(
            self._kv_transfer_config.get_from_extra_config("shared_storage_path", "/tmp")
        )
        os.makedirs(self._storage_path, exist_ok=True)
        # scheduler side
        self._pending: dict[str, PendingSave] = {}
        self._scheduled: set[str] = set()
        # worker side
        self._cache: torch.Tensor | None = None
        self._is_writer = True  # TP rank 0 only; set in register_kv_caches (after distributed init)
        self._saved: set[str] = set()  # copied to host, not yet reported
        self._writes: dict[str, Future] = {}
        threads = int(self._kv_transfer_config.get_from_extra_config("num_writer_threads", 4))
        self._executor = ThreadPoolExecutor(
            max_workers=threads, thread_name_prefix="eagle3-hs-write"
        )
        logger.info(
            "Eagle3HiddenStatesConnector (%s): writing to %s", role.name, self._storage_path
        )

    @staticmethod
    def _hidden_state_group(kv_cache_config: KVCacheConfig | None) -> int:
        """Index of the KV cache group holding the hidden-states buffer (the target's layers are
        another)."""
        if kv_cache_config is None:
            return 0
        from vllm.v1.kv_cache_interface import HiddenStateCacheSpec

        groups = kv_cache_config.kv_cache_groups
        ids = [i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, HiddenStateCacheSpec)]
        if len(ids) == 1:
            return ids[0]
        if not ids and len(groups) == 1:
            return 0
        raise ValueError(
            f"cannot identify the hidden-states KV cache group among {len(groups)} groups"
        )

    def get_finished_count(self) -> int:
        """Only TP rank 0 writes, so one ``finished_sending`` per request (the default waits for
        all ranks)."""
        return 1

    # ---------------- worker side ----------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer

        self._is_writer = get_tensor_model_parallel_rank() == 0
        layers = get_layers_from_vllm_config(
            self._vllm_config, CacheOnlyAttentionLayer, list(kv_caches)
        )
        if len(layers) != 1:
            raise ValueError(f"expected one CacheOnlyAttentionLayer, found {list(layers)}")
        self._cache = kv_caches[next(iter(layers))]
        if self._cache.dim() != 4:
            raise ValueError(
                f"hidden-states buffer has shape {tuple(self._cache.shape)}, expected 4 dims"
            )
        logger.info(
            "hidden-states buffer %s %s on %s",
            tuple(self._cache.shape),
            self._cache.dtype,
            self._cache.device,
        )

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        pass  # store-only

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass  # store-only

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        # the CacheOnlyAttentionLayer already wrote the buffer; we read it when the request finishes
        pass

    def wait_for_save(self) -> None:
        pass

    def _save(self, pending: PendingSave) -> None:
        """Copy the request's rows to host memory now (blocks are freed once we report), write
        later."""
        assert self._cache is not None, "register_kv_caches was not called"
        with (
            gpu_sync_allowed()
        ):  # a deliberate device->host sync (only policed with VLLM_GPU_SYNC_CHECK)
            hidden = gather_blocks(self._cache, pending.block_ids, int(pending.token_ids.shape[0]))
            hidden = hidden.to(
                "cpu"
            ).contiguous()  # synchronous: the blocks are reused once we report
        tensors = {"hidden_states": hidden, "token_ids": pending.token_ids.clone()}
        future = self._executor.submit(write_atomic, tensors, pending.filename)
        self._writes[pending.req_id] = future
        future.add_done_callback(lambda f, rid=pending.req_id: self._write_done(rid, f))
        self._saved.add(pending.req_id)

    def _write_done(self, req_id: str, future: Future) -> None:
        self._writes.pop(req_id, None)
        if future.exception() is not None:
            logger.error("hidden-states write failed for %s: %r", req_id, future.exception())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Copy out the requests that finished last step; report them as sent once copied."""
        if self._is_writer and self.has_connector_metadata():
            meta = self._get_connector_metadata()
            if isinstance(meta, Eagle3HiddenStatesMetadata):
                for pending in meta.pending_saves:
                    self._save(pending)
        # A request's pending save and its id in finished_req_ids arrive in the same step (both
        # come from the scheduler freeing it); a finished id with no save (aborted) is dropped.
        done = finished_req_ids & self._saved
        self._saved -= done
        return done or None, None

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True)  # let pending writes land

    # ---------------- scheduler side ----------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return 0, False  # never loads

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        pass

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        for new_req in scheduler_output.scheduled_new_reqs:
            self._scheduled.add(new_req.req_id)
        meta = Eagle3HiddenStatesMetadata(pending_saves=list(self._pending.values()))
        self._pending.clear()
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Keep the blocks until the worker copied them; tell the client where the file will be."""
        req_id = request.request_id
        if req_id not in self._scheduled:
            return False, None  # aborted before it ever ran: nothing to save
        self._scheduled.discard(req_id)
        if request.prompt_token_ids is None:
            logger.warning("request %s has no prompt_token_ids (prompt embeds): not saved", req_id)
            return False, None
        filename = os.path.join(self._storage_path, f"{req_id}.safetensors")
        token_ids = torch.tensor(list(request.prompt_token_ids), dtype=torch.long)
        self._pending[req_id] = PendingSave(req_id, filename, token_ids, list(block_ids))
        return True, {"hidden_states_path": filename}

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        if not 0 <= self._group_id < len(block_ids):
            return False, None
        return self.request_finished(request, block_ids[self._group_id])

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        # As the reference connector. Only a preference: the CPU platform overrides it with LBHNC,
        # and reads stay right because they index the same logical view the writer indexes.
        return "LBNHC"
