"""Online hidden states: train asks the target for each batch's states instead of reading shards.

Why: stored states grow with the data (SmolLM2 4.6 KB a token, Kimi-K2.5 57 KB: 4.6 TB for the
hero run), and data is the lever that still raises acceptance. With ``extract.states: online``
extract keeps token ids and loss masks only (bytes a token); here :class:`OnlineStates` stands
in for :class:`~eagle3.extract.storage.HiddenStateDataset` (same ``ids``, ``length``,
``batches``, ``fetch``) and produces the states when the trainer asks for them.

Why it is not slower than offline (issue 38; measured in docs/benchmarks.md, "Online states"):

- **Batched and ahead.** The training loop ``request``\\ s the next ``train.online_prefetch``
  batches, half of them at a time (:meth:`OnlineStates.request_ahead`); the in-process target
  (``hf``) computes their missing samples in ``extract.token_budget``-token forwards (as
  extract does, not one training batch at a time), on a thread and CUDA stream of its own
  (:class:`~eagle3.train.producers.ProducerThread`, with the loader's thread) so it overlaps the
  draft's step and the loader's padding instead of queueing behind them, and its states never
  leave the GPU. The vLLM source (``vllm``: the target's extract server, started for the run by
  rank 0 and shared by every training rank) gets the window's requests at once and keeps several
  in flight (``extract.vllm_concurrency`` a rank).
- **Reused at offline speed.** Every produced sample is kept, rounded to
  ``extract.storage_dtype`` (bf16, or fp8 with a scale a row), in one flat :class:`MemoryCache`
  on the training GPU when it fits as offline states do, else in (pinned) host memory; once it
  holds every sample on the training device, later epochs use it as offline's device data and
  the in-process target is closed (:meth:`OnlineStates.device_data`). Then files on disk
  (:class:`StateCache`); the rest is recomputed each epoch. ``train.state_cache_gib: auto``
  (:func:`cache_plan`): hybrid, only the cache after epoch 1 if all fit; ``0``: online.

A sample trains on the same values whether it was just computed, read from memory or disk, or
(offline) read from a shard: every state goes through the same rounding (tests compare the
losses with the offline run's). A non-finite sample counts nothing and is recorded once.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from eagle3.extract.storage import HiddenStateDataset, Sample
from eagle3.generate.storage import JsonlAppender
from eagle3.train.batch import Padded
from eagle3.train.device_data import DeviceData
from eagle3.train.loader import Copied, prefetch_on
from eagle3.train.producers import HFProducer, Job, ProducerThread, VllmProducer, shared_server
from eagle3.train.state_cache import (
    CachePlan,
    MemoryCache,
    StateCache,
    cache_plan,
    from_stored,
    state_bytes,
    stored_form,
)
from eagle3.train.target import TargetHead

NONFINITE = "non-finite hidden states (NaN/inf): not trained on"  # errors.jsonl's reason


class OnlineStates:
    """The stored token ids and loss masks with states produced on demand (module docstring).

    The loop calls ``request(idx)`` for the batches ahead (on its thread); the loader calls
    ``padded(idx)`` for a batch (on its thread, in batch order), which produces what is missing
    and gathers the batch. ``fetch(idx)`` gives the samples themselves (the eager step)."""

    def __init__(
        self,
        tokens: HiddenStateDataset,
        producer: HFProducer | VllmProducer,
        memory: MemoryCache,
        disk: StateCache,
        plan: CachePlan,
        storage_dtype: str,
        dtype: torch.dtype,
        device: torch.device,
        max_seq_len: int,
        errors: Path,
        threaded: bool = False,
    ):
        """``threaded``: the hf target runs on a :class:`ProducerThread` of its own (with the
        loader's thread, ``train.prefetch``); else the loader computes what a batch lacks."""
        self.tokens, self.producer, self.memory, self.disk = tokens, producer, memory, disk
        self.plan, self.storage_dtype, self.dtype = plan, storage_dtype, dtype
        self.device, self.max_seq_len = device, max_seq_len
        self.ids, self.root = tokens.ids, tokens.root
        self.has_states, self.aux_width = True, None  # the producer's states, by construction
        # the target's forwards and the batch's gather overlap the step on a stream of their own
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # the hf target merges the missing samples of every requested batch into its forwards
        # on a GPU; on the CPU one batch's (the same forwards whatever ran before: resumes
        # reproduce a run's states bit for bit)
        self.merge = device.type == "cuda"
        self._lock = threading.Lock()
        self._wanted: list[int] = []  # requested samples not produced yet, in order
        self._inflight: dict[int, Future] = {}  # vllm: requests at the server
        self._fresh: dict[int, dict[str, torch.Tensor]] = {}  # produced, not kept in memory
        self._made: set[int] = set()  # produced, batch not gathered yet (counts as produced)
        self._errors_path = errors
        self.nonfinite: set[str] = set()
        self.counts = {"memory": 0, "disk": 0, "produced": 0}  # where each batch sample came from
        self.epoch_counts: dict[str, int] = dict(self.counts)  # since the last take_epoch()
        self.produce_s = 0.0  # the target's time on the loader's thread
        self.thread = (
            ProducerThread(self._compute_keep, producer.budget, device)
            if threaded and isinstance(producer, HFProducer)
            else None
        )
        self._jobs: dict[int, Job] = {}  # sample -> the producer thread's job computing it
        self._ahead: tuple[list[list[int]], int] | None = None  # (epoch's batches, asked up to)
        self.on_device = False  # device_data() served the cache as offline's device data
        self.closed: str | None = None  # why the producer was closed: "end", "device_data"

    # the dataset interface the trainer uses
    def __len__(self) -> int:
        return len(self.tokens)

    def length(self, i: int) -> int:
        return self.tokens.length(i)

    def batches(self, token_budget: int, shuffle: bool = True, seed: int = 0):
        return self.tokens.batches(token_budget, shuffle, seed)

    def __getitem__(self, i: int) -> Sample:
        return self.fetch([i])[0]

    def _held(self, i: int) -> bool:
        return i in self.memory.start or i in self._fresh or self.disk.has(self.ids[i])

    def request(self, idx: list[int]) -> None:
        """Ask for the samples ``idx`` ahead (the next batches): the vLLM server gets their
        requests now; the hf target's thread gets them as one job, or (no thread) computes them
        with the next batch the loader produces."""
        with self._lock:
            new = [
                i
                for i in dict.fromkeys(idx)
                if not (i in self._inflight or i in self._jobs or i in self._wanted)
                and not self._held(i)
            ]
            for i in new:
                if isinstance(self.producer, VllmProducer):
                    self._inflight[i] = self.producer.submit(
                        self.ids[i], self.tokens[i].input_ids.tolist()
                    )
                elif self.thread is None:
                    self._wanted.append(i)
            if new and self.thread is not None:
                job = self.thread.submit(new, sum(self.tokens.length(i) for i in new))
                self._jobs.update(dict.fromkeys(new, job))

    def request_ahead(
        self, batches: list[list[int]], at: int, window: int, rank: int = 0, world: int = 1
    ) -> None:
        """The loop's window: ask for this rank's share of ``batches[at : at + window]`` once
        half the window asked for last time has been trained, not every step. So the target
        gets half a window of new samples at a time (``online_prefetch`` / 2 training batches:
        forwards of up to ``extract.token_budget`` tokens, as extract's) instead of one training
        batch a step, which left its forwards small and its per-forward cost paid ~8x as often."""
        last = self._ahead
        if last is not None and last[0] is batches and at < last[1] - window // 2:
            return
        self._ahead = (batches, at + window)
        self.request([i for idx in batches[at : at + window][rank::world] for i in idx])

    def _compute_keep(self, idx: list[int]) -> None:
        """The hf target's states of ``idx`` (on the current stream), kept."""
        seqs = [self.tokens[i].input_ids.tolist() for i in idx]
        for i, (aux, final, ok) in zip(idx, self.producer.compute(seqs)):
            self._keep(i, aux, final, ok)

    def _produce(self, idx: list[int]) -> None:
        """Make every sample of ``idx`` held (memory, disk or fresh): wait for the producer
        thread's jobs that compute them, compute the rest here."""
        with self._lock:
            jobs = {id(j): j for i in idx if (j := self._jobs.get(i)) is not None}
        for job in jobs.values():
            self.thread.wait(job, self.stream)
        with self._lock:  # only now: a request meanwhile would have queued them again
            for i in idx:
                self._jobs.pop(i, None)
        missing = [i for i in idx if not self._held(i)]
        if not missing:
            return
        t0 = time.perf_counter()
        if isinstance(self.producer, VllmProducer):
            with self._lock:
                futures = {
                    i: self._inflight.pop(i, None)
                    or self.producer.submit(self.ids[i], self.tokens[i].input_ids.tolist())
                    for i in missing
                }
            for i, f in futures.items():
                self._keep(i, *self.producer.split(f.result()))
        else:
            with self._lock:
                if self.merge:  # and every other requested sample not held yet
                    missing += [i for i in self._wanted if i not in missing and not self._held(i)]
                self._wanted = [i for i in self._wanted if i not in set(missing)]
            self._compute_keep(missing)
        self.produce_s += time.perf_counter() - t0

    def _keep(self, i: int, aux: torch.Tensor, final: torch.Tensor, finite: bool) -> None:
        """Round to the storage dtype and keep: memory if there is room, else disk if there is,
        and until its batch is gathered in any case. A non-finite sample counts nothing (its
        loss mask cleared, its states zeroed) and is recorded once."""
        if not finite:
            sid = self.ids[i]
            if sid not in self.nonfinite:
                self.nonfinite.add(sid)
                out = JsonlAppender(self._errors_path)
                out.append({"id": sid, "reason": NONFINITE, "time": time.time()})
                out.close()
            aux, final = torch.zeros_like(aux), torch.zeros_like(final)
            self._fresh[i] = stored_form(aux, final, self.storage_dtype)
            self._made.add(i)
            return
        stored = stored_form(aux, final, self.storage_dtype)
        self._made.add(i)
        if self.memory.put(i, stored):
            return
        self.disk.put(self.ids[i], stored)
        self._fresh[i] = stored

    def _count(self, i: int, where: str) -> None:
        """Count sample ``i`` of a batch: produced for it, or read from ``where``."""
        if i in self._made:
            self._made.discard(i)
            where = "produced"
        self.counts[where] += 1

    def _stored(self, i: int) -> dict[str, torch.Tensor]:
        """Sample ``i``'s stored states for its batch, counting where they came from."""
        if i in self._fresh:
            self._count(i, "produced")
            stored = self._fresh.pop(i)
            if self.stream is not None:  # made on the producer's stream, read on this one
                for t in stored.values():
                    t.record_stream(self.stream)
            return stored
        if i in self.memory.start:
            self._count(i, "memory")
            return self.memory.get(i)
        hit = self.disk.get(self.ids[i])
        if hit is None:  # not requested ahead and not held: produce now
            self._produce([i])
            return self._stored(i)
        self._count(i, "disk")
        return hit

    def _tokens(self, idx: list[int]) -> tuple[list[Sample], list[int]]:
        samples = [self.tokens[i] for i in idx]
        for s in samples:
            if s.id in self.nonfinite:
                s.loss_mask = torch.zeros_like(s.loss_mask)
        return samples, [min(len(s), self.max_seq_len) for s in samples]

    def padded(self, idx: list[int]) -> Padded | Copied:
        """The batch ``idx`` zero-padded (ids, mask, aux, final, valid), the loader's source:
        on a GPU already on the device (:class:`~eagle3.train.loader.Copied`, made on this
        object's stream), else on the host. Samples all in memory are one gather per tensor."""
        stream = self.stream
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            self._produce(idx)
            samples, lens = self._tokens(idx)
            b, L = len(idx), max(lens)
            pin = stream is not None
            ids = torch.zeros(b, L, dtype=torch.int64, pin_memory=pin)
            mask = torch.zeros(b, L, dtype=torch.bool, pin_memory=pin)
            valid = torch.zeros(b, L, dtype=torch.bool, pin_memory=pin)
            for j, (s, n) in enumerate(zip(samples, lens)):
                ids[j, :n], mask[j, :n], valid[j, :n] = s.input_ids[:n], s.loss_mask[:n], True
            dev = self.device
            if all(i in self.memory.start for i in idx):
                for i in idx:
                    self._count(i, "memory")
                aux, final = self.memory.gather(idx, lens, self.dtype)
                aux = aux.to(dev, non_blocking=True)
                final = final.to(dev, non_blocking=True)
            else:
                states = [from_stored(self._stored(i), self.dtype) for i in idx]
                a0, f0 = states[0]
                aux = torch.zeros(b, L, a0.shape[-1], dtype=self.dtype, device=dev)
                final = torch.zeros(b, L, f0.shape[-1], dtype=self.dtype, device=dev)
                for j, ((a, f), n) in enumerate(zip(states, lens)):
                    aux[j, :n] = a[:n].to(dev, non_blocking=True)
                    final[j, :n] = f[:n].to(dev, non_blocking=True)
            if stream is None:
                return Padded(ids, mask, aux, final, valid, lens)
            host = (ids, mask, valid)
            ids, mask, valid = (x.to(dev, non_blocking=True) for x in host)
            ready = torch.cuda.Event()
            ready.record(stream)
        return Copied((ids, mask, aux, final, valid), lens, ready)

    def fetch(self, idx: list[int]) -> list[Sample]:
        """The samples ``idx`` with their states (in ``dtype``, on the host)."""
        with torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
            self._produce(idx)
            samples, _ = self._tokens(idx)
            for i, s in zip(idx, samples):
                aux, final = from_stored(self._stored(i), self.dtype)
                s.aux, s.final = aux.cpu(), final.cpu()
        return samples

    def device_data(self, head: TargetHead) -> DeviceData | None:
        """The memory cache as offline's device data (the target's argmax of every token
        computed once) once it holds every sample on the training device: later epochs gather
        each batch as offline does (issue 38: the loader's path ran them 1.44x slower), and the
        in-process target is closed (weights, thread, its forwards' memory; a shared vLLM server
        stays up for the other ranks). None while a sample is not held there (a non-finite one
        never is) or the cache is in host memory under a GPU step."""
        m = self.memory
        if m.device.type != self.device.type or len(m.start) < len(self):
            return None
        data = m.as_device_data(self.tokens, self.device)
        data.remember_argmax(head)
        self.on_device = True
        if isinstance(self.producer, HFProducer):
            self.close("device_data")
            torch.cuda.empty_cache()  # (a no-op without CUDA)
        return data

    def count_memory(self, idx: list[int]) -> None:
        """A batch gathered from :meth:`device_data`: its samples came from the memory cache."""
        for i in idx:
            self._count(i, "memory")

    def take_epoch(self) -> dict[str, Any]:
        """Where the batch samples since the last call came from (the loop's epoch line):
        ``cached`` is the share read from memory or disk instead of the target."""
        got = {k: self.counts[k] - self.epoch_counts[k] for k in self.counts}
        self.epoch_counts = dict(self.counts)
        n = sum(got.values())
        return {**got, "cached": round((got["memory"] + got["disk"]) / n, 4) if n else None}

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "cache_plan": self.plan.as_dict(),
            "memory_bytes": self.memory.bytes,
            "memory_samples": len(self.memory.start),
            "disk_bytes": self.disk.bytes,
            "disk_peak_bytes": self.disk.peak,
            "disk_samples": len(self.disk.sizes),
            "from_memory": self.counts["memory"],
            "from_disk": self.counts["disk"],
            "produced": self.counts["produced"],
            "produce_s": round(self.produce_s + (self.thread.busy_s if self.thread else 0), 2),
            "producer_thread": self.thread is not None,
            "device_data": self.on_device,  # later epochs gathered as offline's (device_data)
            "target_released": self.closed == "device_data",  # hf: closed at the switch
            "nonfinite": len(self.nonfinite),
        }
        if isinstance(self.producer, VllmProducer):
            out["max_requests_in_flight"] = self.producer.server.max_in_flight
        return out

    def close(self, why: str = "end") -> None:
        if self.closed:
            return
        self.closed = why
        if self.thread is not None:
            self.thread.close()
        with self._lock:
            for f in self._inflight.values():
                f.cancel()
            self._inflight.clear()
            self._jobs.clear()
        self._fresh.clear()
        self._made.clear()
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
    """The run's online states: its producer (``extract.backend``), its memory cache and its
    disk cache under ``out_dir/state-cache``, keyed by the extract settings the states depend
    on. Under torchrun each rank keeps its share of the budget: memory of its own, the disk
    folder shared (a rank gets other batches every epoch; any rank's file is a hit)."""
    from eagle3.extract.runner import settings_key

    e, tc = cfg.extract, cfg.train
    producer: HFProducer | VllmProducer = (  # first: the free GPU memory is what it leaves
        shared_server(cfg, target_dir, out_dir, rank, world)
        if e.backend == "vllm"
        else HFProducer(cfg, str(target_dir), device)
    )
    hidden = cfg.target.hidden_size
    aux_width = len(cfg.aux_layers) * hidden
    total = state_bytes(
        sum(tokens.length(i) for i in range(len(tokens))), aux_width, hidden, e.storage_dtype
    )
    root = out_dir / "state-cache"
    plan = cache_plan(tc.state_cache_gib, tc.state_cache_memory_gib, total, device, root, world)
    per_token = state_bytes(1, aux_width, hidden, e.storage_dtype)
    memory = MemoryCache(
        plan.memory // per_token,
        aux_width,
        hidden,
        e.storage_dtype,
        plan.memory_device,
        pin=device.type == "cuda",
    )
    settings = {"settings_key": settings_key(cfg), "storage_dtype": e.storage_dtype}
    if world > 1 and rank > 0:
        dist.barrier()  # rank 0 tidies the shared folder first (below)
    disk = StateCache(root, plan.disk, settings, owner=rank == 0, world=world)
    if world > 1 and rank == 0:
        dist.barrier()
    return OnlineStates(
        tokens,
        producer,
        memory,
        disk,
        plan,
        e.storage_dtype,
        dtype,
        device,
        tc.max_seq_len,
        out_dir / "errors.jsonl",
        threaded=prefetch_on(tc.prefetch, device),
    )


__all__ = ["OnlineStates", "open_online", "states_report"]
