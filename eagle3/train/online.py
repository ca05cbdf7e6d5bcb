"""Online hidden states: train asks the target for each batch's states instead of reading shards.

Why: stored states grow with the data (SmolLM2 4.6 KB a token, Kimi-K2.5 57 KB: 4.6 TB for the
hero run), and data is the lever that still raises acceptance. With ``extract.states: online``
extract keeps token ids and loss masks only (bytes a token); here :class:`OnlineStates` stands
in for :class:`~eagle3.extract.storage.HiddenStateDataset` (same ``ids``, ``length``,
``batches``, ``fetch``) and produces each batch's states when the trainer asks for them:

- ``hf``: the target loaded in this process (transformers, :mod:`eagle3.extract.hf_backend`'s
  hooks), on the training device; on a GPU its forward runs on the loader thread's own stream,
  so it overlaps the step on the compute stream.
- ``vllm``: the target's vLLM extract server (:class:`~eagle3.extract.vllm_backend.StateServer`,
  the extract backend's server and connector), started for the run; ``request`` sends the next
  batches' samples while the current step trains (``train.online_prefetch`` batches ahead).

Every state goes through the rounding of ``extract.storage_dtype`` (bf16, or fp8 with a scale per
row), so a sample trains on the same values whether it was just computed, read from the cache,
or (offline) read from a shard: online and offline runs give the same losses (tests). A bounded
:class:`StateCache` keeps the first samples that fit in ``train.state_cache_gib`` for later
epochs; the rest is recomputed each epoch. Nothing else is written, so the disk a run holds is
the cache (plus the vLLM connector's per-request files, deleted once read).
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from concurrent.futures import Future
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eagle3.atomic import atomic_path, write_json_atomic
from eagle3.batching import token_budget_batches
from eagle3.extract.storage import HiddenStateDataset, Sample, decode_states, encode_states
from eagle3.generate.storage import JsonlAppender


def stored_form(aux: torch.Tensor, final: torch.Tensor, storage_dtype: str) -> dict[str, Any]:
    """The tensors a shard (or the cache) keeps for one sample's states."""
    return {
        **encode_states("aux", aux, storage_dtype),
        **encode_states("final", final, storage_dtype),
    }


def from_stored(
    t: dict[str, torch.Tensor], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    fp8 = "aux_scale" in t
    return (
        decode_states(t.__getitem__, "aux", fp8, dtype),
        decode_states(t.__getitem__, "final", fp8, dtype),
    )


class StateCache:
    """At most ``budget_bytes`` of samples' stored states, one safetensors file each.

    The first samples that fit stay (nothing is evicted: with a new order every epoch any policy
    hits budget / total of the time, and this one writes each file once). Files are written under
    a temporary name and renamed, so a killed run leaves whole files only; ``settings`` (the
    extract settings the states depend on) is checked at open, and a cache made with others is
    emptied."""

    def __init__(self, root: Path, budget_bytes: int, settings: dict[str, Any]):
        self.root, self.budget = Path(root), int(budget_bytes)
        self.root.mkdir(parents=True, exist_ok=True)
        marker = self.root / "cache.json"
        same = marker.is_file() and json.loads(marker.read_text()) == settings
        for f in self.root.iterdir():
            if f.name.endswith(".tmp") or (not same and f.suffix == ".safetensors"):
                f.unlink()
        write_json_atomic(marker, settings)
        self.sizes = {f.stem: f.stat().st_size for f in self.root.glob("*.safetensors")}
        self.bytes = sum(self.sizes.values())
        self.peak = self.bytes
        self.hits = self.misses = 0
        self._lock = threading.Lock()

    @staticmethod
    def _name(sample_id: str) -> str:
        return hashlib.sha1(sample_id.encode()).hexdigest()

    def get(self, sample_id: str) -> dict[str, torch.Tensor] | None:
        name = self._name(sample_id)
        with self._lock:
            if name not in self.sizes:
                self.misses += 1
                return None
            self.hits += 1
        with safe_open(str(self.root / f"{name}.safetensors"), framework="pt") as h:
            return {k: h.get_tensor(k) for k in h.keys()}

    def put(self, sample_id: str, tensors: dict[str, torch.Tensor]) -> bool:
        """Keep the sample if it fits the budget (header included); True if kept."""
        name = self._name(sample_id)
        need = sum(t.numel() * t.element_size() for t in tensors.values()) + 1024
        with self._lock:
            if name in self.sizes or self.bytes + need > self.budget:
                return False
            self.sizes[name] = need  # reserved: another thread may not take the same room
            self.bytes += need
        path = self.root / f"{name}.safetensors"
        with atomic_path(path) as tmp:
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
        size = path.stat().st_size
        with self._lock:
            self.bytes += size - self.sizes[name]
            self.sizes[name] = size
            self.peak = max(self.peak, self.bytes)
        return True


def disk_bytes(folder: Path) -> int:
    """Bytes of every file under ``folder`` (what the run holds there now)."""
    return sum(f.stat().st_size for f in Path(folder).rglob("*") if f.is_file())


class HFProducer:
    """The target in this process: its base model with hooks at the auxiliary layers."""

    def __init__(self, cfg: Any, model_path: str, device: torch.device):
        from eagle3.extract.hf_backend import LayerTap, load_base_model, pick_dtype

        e = cfg.extract
        self.device, self.budget = device, e.token_budget
        self.model = load_base_model(
            model_path, device, pick_dtype(e.dtype, device), cfg.target.trust_remote_code
        )
        self.tap = LayerTap(self.model, list(cfg.aux_layers))
        # the loader thread's forwards go on a stream of their own: they overlap the training
        # step on the compute stream instead of queueing behind it
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def compute(
        self, items: list[tuple[str, list[int]]]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        from eagle3.extract.hf_backend import forward_states

        out: list[Any] = [None] * len(items)
        with torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
            for b in token_budget_batches([len(t) for _, t in items], self.budget):
                states = forward_states(self.model, self.tap, [items[i][1] for i in b], self.device)
                for i, s in zip(b, states):
                    out[i] = s
        return out

    def close(self) -> None:
        self.tap.remove()
        del self.model


class VllmProducer:
    """The target's vLLM extract server (started here, stopped at ``close``)."""

    def __init__(self, cfg: Any, model_path: str, work_dir: Path):
        from eagle3.extract.vllm_backend import StateServer

        n, layers = cfg.target.num_hidden_layers, list(cfg.aux_layers)
        self.n_aux = len(layers)
        self.server = StateServer(
            online_server_cfg(cfg),
            model_path,
            [*layers, n],  # layer N: the final pre-norm state
            work_dir,
            concurrency=cfg.extract.vllm_concurrency,
        )
        self.work_dir = Path(work_dir)

    def submit(self, sample_id: str, token_ids: list[int]) -> Future:
        return self.server.submit(sample_id, token_ids)

    def split(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return hidden[:, : self.n_aux].flatten(1), hidden[:, self.n_aux]

    def close(self) -> None:
        self.server.close()


def online_server_cfg(cfg: Any) -> Any:
    """The profile with the online layout applied to serve: the extract server's GPUs
    (``extract.online_server_gpus`` as CUDA_VISIBLE_DEVICES) and its share of their memory."""
    e, s = cfg.extract, cfg.serve
    update: dict[str, Any] = {}
    if e.online_server_gpus is not None:
        update["env"] = {**s.env, "CUDA_VISIBLE_DEVICES": e.online_server_gpus}
    if e.online_gpu_memory_utilization is not None:
        update["gpu_memory_utilization"] = e.online_gpu_memory_utilization
    return cfg.model_copy(update={"serve": s.model_copy(update=update)}) if update else cfg


class OnlineStates:
    """The stored token ids and loss masks with states produced on demand (module docstring).

    ``request(idx)`` asks for a batch's states ahead (vLLM: its requests go out now; a no-op for
    the in-process target); ``fetch(idx)`` returns the batch's samples, from the cache or the
    producer. ``fetch`` may run on the loader thread while ``request`` runs on the step's."""

    def __init__(
        self,
        tokens: HiddenStateDataset,
        producer: HFProducer | VllmProducer,
        cache: StateCache,
        storage_dtype: str,
        dtype: torch.dtype,
        errors: Path,
    ):
        self.tokens, self.producer, self.cache = tokens, producer, cache
        self.storage_dtype, self.dtype = storage_dtype, dtype
        self.ids, self.root = tokens.ids, tokens.root
        self.has_states = True
        self.aux_width = None  # the producer's, by construction
        self._inflight: dict[int, Future] = {}
        self._lock = threading.Lock()
        self._errors_path = errors
        self.produced = 0  # samples computed by the target
        self.produce_s = 0.0  # time fetch waited for the target (the loader's, not the step's)
        self.nonfinite: set[str] = set()

    # the dataset interface the trainer uses
    def __len__(self) -> int:
        return len(self.tokens)

    def length(self, i: int) -> int:
        return self.tokens.length(i)

    def batches(self, token_budget: int, shuffle: bool = True, seed: int = 0):
        return self.tokens.batches(token_budget, shuffle, seed)

    def __getitem__(self, i: int) -> Sample:
        return self.fetch([i])[0]

    def request(self, idx: list[int]) -> None:
        """Start computing the samples ``idx`` that the cache does not hold (vLLM only)."""
        if not isinstance(self.producer, VllmProducer):
            return
        for i in idx:
            with self._lock:
                if i in self._inflight or self.cache._name(self.ids[i]) in self.cache.sizes:
                    continue
                s = self.tokens[i]
                self._inflight[i] = self.producer.submit(s.id, s.input_ids.tolist())

    def fetch(self, idx: list[int]) -> list[Sample]:
        samples = [self.tokens[i] for i in idx]
        states: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        todo: list[int] = []
        for j, s in enumerate(samples):
            hit = self.cache.get(s.id)
            if hit is not None:
                states[j] = from_stored(hit, self.dtype)
            else:
                todo.append(j)
        if todo:
            t0 = time.perf_counter()
            computed = self._compute([idx[j] for j in todo], [samples[j] for j in todo])
            self.produce_s += time.perf_counter() - t0
            self.produced += len(todo)
            for j, (aux, final) in zip(todo, computed):
                states[j] = self._keep(samples[j], aux, final)
        for j, s in enumerate(samples):
            s.aux, s.final = states[j]
        return samples

    def _compute(
        self, idx: list[int], samples: list[Sample]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if isinstance(self.producer, VllmProducer):
            with self._lock:
                futures = [
                    self._inflight.pop(i, None) or self.producer.submit(s.id, s.input_ids.tolist())
                    for i, s in zip(idx, samples)
                ]
            return [self.producer.split(f.result()) for f in futures]
        return self.producer.compute([(s.id, s.input_ids.tolist()) for s in samples])

    def _keep(
        self, s: Sample, aux: torch.Tensor, final: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Round to the storage dtype, cache if there is room; a non-finite sample counts
        nothing (its loss mask cleared, its states zeroed) and is recorded once."""
        if not (torch.isfinite(aux).all() and torch.isfinite(final).all()):
            if s.id not in self.nonfinite:
                self.nonfinite.add(s.id)
                out = JsonlAppender(self._errors_path)
                out.append(
                    {
                        "id": s.id,
                        "reason": "non-finite hidden states (NaN/inf): not trained on",
                        "time": time.time(),
                    }
                )
                out.close()
            s.loss_mask = torch.zeros_like(s.loss_mask)
            return torch.zeros_like(aux, dtype=self.dtype), torch.zeros_like(
                final, dtype=self.dtype
            )
        stored = stored_form(aux.cpu(), final.cpu(), self.storage_dtype)
        self.cache.put(s.id, stored)
        return from_stored(stored, self.dtype)

    def stats(self) -> dict[str, Any]:
        return {
            "cache_hits": self.cache.hits,
            "cache_misses": self.cache.misses,
            "cache_bytes": self.cache.bytes,
            "cache_peak_bytes": self.cache.peak,
            "cache_budget_bytes": self.cache.budget,
            "produced": self.produced,
            "produce_s": round(self.produce_s, 2),
            "nonfinite": len(self.nonfinite),
        }

    def close(self) -> None:
        with self._lock:
            for f in self._inflight.values():
                f.cancel()
            self._inflight.clear()
        self.producer.close()


def states_report(extract: Any, loader: Any, ds: Any) -> dict[str, Any]:
    """Where the states came from and, online, what producing them cost: the target's time
    (``produce_s``, on the loader thread or the server) against the time the step waited for
    batches (``step_wait_s``): the difference was hidden behind the draft's steps."""
    out: dict[str, Any] = {"mode": extract.states, "backend": extract.backend}
    if loader is not None:
        out["step_wait_s"] = round(loader.wait_s, 2)
    if isinstance(ds, OnlineStates):
        out.update(ds.stats())
    return out


def open_online(
    cfg: Any,
    tokens: HiddenStateDataset,
    target_dir: Path,
    out_dir: Path,
    device: torch.device,
    dtype: torch.dtype,
    rank: int = 0,
    world: int = 1,
) -> OnlineStates:
    """The run's online states: its producer (``extract.backend``) and its cache under
    ``out_dir/state-cache``, keyed by the extract settings the states depend on. Under torchrun
    each rank keeps its own cache of ``1/world`` of the budget (ranks see different samples)."""
    from eagle3.extract.runner import settings_key

    e = cfg.extract
    if e.backend == "vllm" and world > 1:
        raise ValueError(
            "extract.states online with extract.backend vllm runs one training process for now "
            "(train.nproc_per_node 1, or grad_accum for the same global batch): several ranks "
            "would each start a server. Offline states, or the hf backend, train on any number."
        )
    cache = StateCache(
        out_dir / "state-cache" / (f"rank{rank}" if world > 1 else ""),
        int(cfg.train.state_cache_gib * 1024**3 / world),
        {"settings_key": settings_key(cfg), "storage_dtype": e.storage_dtype},
    )
    producer: HFProducer | VllmProducer = (
        VllmProducer(cfg, str(target_dir), out_dir / "vllm-work")
        if e.backend == "vllm"
        else HFProducer(cfg, str(target_dir), device)
    )
    return OnlineStates(tokens, producer, cache, e.storage_dtype, dtype, out_dir / "errors.jsonl")


__all__ = [
    "HFProducer",
    "OnlineStates",
    "StateCache",
    "VllmProducer",
    "disk_bytes",
    "open_online",
    "states_report",
]
