"""The fast step's batches read from the stored shards: padded on a host thread one step ahead,
the target's full-vocab argmax kept per sample after its first batch.

Why (issue 15): at Kimi-K2.5 dims one 2,048-token sample is 88 MB of padded bf16 states, and
padding it into pinned memory in the step's own thread, plus the 163,840-row target head, was the
"batch" phase of a ~160 ms step on the H200 (11.5 ms at TTT 7). Here the host work of the next
step (reading the shards, padding) runs on a thread while this step runs, and on a GPU so does
its copy to the device, on a side stream that the compute stream waits for (on the GPU, not the
host); the target distribution stays on the caller's thread and stream. The argmax of a stored
token never changes, so from a sample's second batch on only the draft rows of the target head
run (32,000 of 163,840 for Kimi; 8,192 of 49,152 for SmolLM2). It costs 4 bytes a token of
device memory (36 MB for 9 M tokens).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle3.errors import MissingSamples
from eagle3.extract.storage import HiddenStateDataset, Sample
from eagle3.train.batch import Batch, Padded, batch_from_padded, pad_samples
from eagle3.train.target import TargetHead


def open_extract(
    extract_dir: Path, aux_layers: list[int], bf16: bool = False
) -> HiddenStateDataset:
    """The extract folder, checked against its manifest (aux layers, sample count): its stored
    hidden states, or (``extract.states: online``) its token ids and loss masks alone
    (``ds.has_states`` False; train then produces the states, eagle3/train/online.py).

    Read as float32, or with ``bf16`` in bfloat16 (the storage dtype; fp8 shards dequantised to
    it): on a GPU the step reads the states in bf16 anyway, and half the bytes cross to it."""
    ds = HiddenStateDataset(extract_dir, dtype=torch.bfloat16 if bf16 else torch.float32)
    if len(ds) == 0:
        raise ValueError(f"{extract_dir}: no samples")
    man_path = extract_dir / "manifest.json"
    if man_path.is_file():
        extract_manifest = json.loads(man_path.read_text())
        stored = extract_manifest.get("aux_layers")
        if stored is not None and list(stored) != aux_layers:
            raise ValueError(f"extract stored aux layers {stored}, config says {aux_layers}")
        listed = extract_manifest.get("samples")
        if listed is not None and len(ds) < int(listed):
            raise MissingSamples(
                f"{extract_dir}: manifest.json lists {listed} samples, index.json {len(ds)}: the "
                "folder was changed after extract; rerun extract into it, then train"
            )
    return ds


def prefetch_on(setting: str, device: torch.device) -> bool:
    """``train.prefetch`` resolved: on / off, or auto (on CUDA; on the CPU the thread would take
    a core from the step)."""
    return setting == "on" or (setting == "auto" and device.type == "cuda")


@dataclass
class Copied:
    """A padded batch already on its way to the GPU on the loader's stream."""

    tensors: tuple[torch.Tensor, ...]  # ids, mask, aux, final, valid
    lens: list[int]
    ready: torch.cuda.Event

    def take(self) -> tuple[torch.Tensor, ...]:
        """The tensors, for the current (compute) stream: it waits for the copy (on the GPU, the
        host does not block), and the allocator is told they are used there."""
        stream = torch.cuda.current_stream(self.tensors[0].device)
        stream.wait_event(self.ready)
        for t in self.tensors:
            t.record_stream(stream)
        return self.tensors


class Loader:
    """``batch(idx)``: the fast step's batch of samples ``idx`` (as
    :func:`eagle3.train.batch.make_batch_fast` builds it, the same values); ``prefetch(groups)``
    starts the host work of batches asked for next (with ``prefetch=True``; else a no-op).

    With a thread, ``sample`` / ``fetch`` is only ever called on it (the shards' handles are not
    shared between threads), in the order batches were asked for."""

    def __init__(
        self,
        sample: Callable[[int], Sample] | None,
        head: TargetHead,
        device: torch.device,
        max_seq_len: int,
        positions: str = "predicted",
        prefetch: bool = False,
        chunk: int = 1024,
        fetch: Callable[[list[int]], list[Sample]] | None = None,
        make: Callable[[list[int]], Padded | Copied] | None = None,
    ) -> None:
        """``sample(i)`` reads one sample, ``fetch(idx)`` a batch of them, or ``make(idx)`` pads
        the batch itself (the online states: produced and gathered on the device)."""
        self.make = make
        if fetch is None and make is None:
            assert sample is not None
            fetch = lambda idx: [sample(i) for i in idx]  # noqa: E731
        self.fetch, self.head, self.device = fetch, head, device
        self.wait_s = 0.0  # time the step's thread waited for batches (prefetch not done yet)
        self.max_seq_len, self.positions, self.chunk = max_seq_len, positions, chunk
        self.pin = device.type == "cuda" and torch.cuda.is_available()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="eagle3-loader") if prefetch else None
        # the thread's copies to the GPU go on their own stream: they overlap the step running
        # on the compute stream instead of queueing behind it (a Kimi sample: ~117 MB, ~2-5 ms)
        self._stream = torch.cuda.Stream(device) if self.pin and prefetch else None
        self._ahead: dict[tuple[int, ...], Future[Padded | Copied]] = {}
        self._arg: dict[int, torch.Tensor] = {}  # sample -> [n] int32 on the device

    def _host(self, idx: list[int]) -> Padded | Copied:
        if self.make is not None:
            made = self.make(idx)
            if isinstance(made, Copied):
                return made
            host = made
        else:
            host = pad_samples(self.fetch(idx), self.max_seq_len, self.pin)
        if self._stream is None:
            return host
        with torch.cuda.stream(self._stream):
            tensors = host.to(self.device)
            ready = torch.cuda.Event()
            ready.record(self._stream)
        return Copied(tensors, host.lens, ready)

    def prefetch(self, groups: list[list[int]]) -> None:
        """Start padding each batch of ``groups`` on the loader thread (in order)."""
        if self._pool is None:
            return
        for idx in groups:
            if tuple(idx) not in self._ahead:
                self._ahead[tuple(idx)] = self._pool.submit(self._host, idx)

    def batch(self, idx: list[int]) -> Batch:
        """The batch of ``idx``: prefetched if it was (its errors surface here), else padded now."""
        ahead = self._ahead.pop(tuple(idx), None)
        if ahead is None and self._pool is not None:  # every shard read on the one thread
            ahead = self._pool.submit(self._host, idx)
        t0 = time.perf_counter()
        host = ahead.result() if ahead is not None else self._host(idx)
        self.wait_s += time.perf_counter() - t0
        if isinstance(host, Copied):
            ids, mask, aux, final, valid = host.take()
        else:
            ids, mask, aux, final, valid = host.to(self.device)
        known = all(i in self._arg and self._arg[i].numel() >= n for i, n in zip(idx, host.lens))
        arg = self._stacked(idx, host.lens) if known else None
        b = batch_from_padded(
            ids, mask, aux, final, valid, self.head, self.chunk, self.positions, arg
        )
        if not known:
            for j, (i, n) in enumerate(zip(idx, host.lens)):
                self._arg[i] = b.target_arg[j, :n].to(torch.int32)
        return b

    def _stacked(self, idx: list[int], lens: list[int]) -> torch.Tensor:
        """The remembered argmax of ``idx`` cut to ``lens``, as [B, max(lens)], -1 beyond."""
        out = torch.full((len(idx), max(lens)), -1, dtype=torch.int64, device=self.device)
        for j, (i, n) in enumerate(zip(idx, lens)):
            out[j, :n] = self._arg[i][:n]
        return out

    def close(self) -> None:
        """Stop the loader thread (batches asked for but never taken are dropped)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._ahead.clear()


__all__ = ["Loader", "open_extract", "prefetch_on"]
