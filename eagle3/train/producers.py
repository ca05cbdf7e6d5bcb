"""Who computes the target's states for online training (eagle3/train/online.py): the target in
the training process (:class:`HFProducer`, transformers) or its vLLM extract server
(:class:`VllmProducer`), one server shared by every training rank (:func:`shared_server`)."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from eagle3.batching import token_budget_batches


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
        self._lock = threading.Lock()  # one forward at a time: the tap's buffers are shared

    def compute(self, seqs: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor, bool]]:
        """(aux, final, finite) of each sequence, on the model's device (the current stream),
        in ``extract.token_budget``-token forwards; one host sync per forward (the finite flags)."""
        from eagle3.extract.hf_backend import forward_states

        out: list[Any] = [None] * len(seqs)
        for b in token_budget_batches([len(s) for s in seqs], self.budget):
            with self._lock:
                states = forward_states(
                    self.model, self.tap, [seqs[i] for i in b], self.device, to_host=False
                )
            ok = torch.stack(
                [torch.isfinite(a).all() & torch.isfinite(f).all() for a, f in states]
            ).tolist()
            for i, (a, f), good in zip(b, states, ok):
                out[i] = (a, f, good)
        return out

    def close(self) -> None:
        self.tap.remove()
        del self.model


@dataclass
class Job:
    """Samples the producer thread computes and keeps; ``done`` once kept (or failed)."""

    idx: list[int]
    tokens: int
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    event: Any = None  # a torch.cuda.Event recorded on the producer's stream after the keep


class ProducerThread:
    """The in-process target on a thread and a CUDA stream of its own, running ahead of the
    loader: the loop's ``request`` queues a job of the batches ahead, this thread computes and
    keeps it (``compute_keep``) while the loader pads earlier batches and the step trains, so a
    burst of production never holds up the padding of a batch already held. Jobs queued
    together are merged up to ``budget`` tokens (extract's forward size)."""

    def __init__(
        self, compute_keep: Callable[[list[int]], None], budget: int, device: torch.device
    ):
        self.compute_keep, self.budget = compute_keep, budget
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.busy_s = 0.0  # the target's time on this thread
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="eagle3-target", daemon=True)
        self._thread.start()

    def submit(self, idx: list[int], tokens: int) -> Job:
        job = Job(list(idx), tokens)
        self._queue.put(job)
        return job

    def _next_jobs(self, first: Job) -> list[Job]:
        jobs, tokens = [first], first.tokens
        while tokens < self.budget:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is None:  # close() asked: stop after this group
                self._queue.put(None)
                break
            jobs.append(job)
            tokens += job.tokens
        return jobs

    def _work(self) -> None:
        while (first := self._queue.get()) is not None:
            jobs = self._next_jobs(first)
            t0 = time.perf_counter()
            try:
                with torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
                    self.compute_keep([i for j in jobs for i in j.idx])
                    event = None
                    if self.stream is not None:
                        event = torch.cuda.Event()
                        event.record(self.stream)
                for j in jobs:
                    j.event = event
            except BaseException as e:  # noqa: BLE001 - handed to the loader, raised there
                for j in jobs:
                    j.error = e
            finally:
                self.busy_s += time.perf_counter() - t0
                for j in jobs:
                    j.done.set()

    def wait(self, job: Job, stream: Any) -> None:
        """Block until ``job`` is kept; the caller's CUDA ``stream`` waits for its copies (on
        the device: the host does not block on them)."""
        job.done.wait()
        if job.error is not None:
            raise RuntimeError(f"the target failed on samples {job.idx[:5]}...") from job.error
        if job.event is not None and stream is not None:
            stream.wait_event(job.event)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=60)


class VllmProducer:
    """The target's vLLM extract server: started here and stopped at ``close``, or (``attach``)
    rank 0's, shared by every training rank of the run (one server, N ranks)."""

    def __init__(self, cfg: Any, model_path: str, work_dir: Path, attach: Any = None):
        from eagle3.extract.vllm_backend import StateServer

        n, layers = cfg.target.num_hidden_layers, list(cfg.aux_layers)
        self.n_aux = len(layers)
        self.server = StateServer(
            online_server_cfg(cfg),
            model_path,
            [*layers, n],  # layer N: the final pre-norm state
            work_dir,
            concurrency=cfg.extract.vllm_concurrency,
            attach=attach,
        )
        self.work_dir = Path(work_dir)

    def submit(self, sample_id: str, token_ids: list[int]) -> Future:
        return self.server.submit(sample_id, token_ids)

    def split(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
        aux, final = hidden[:, : self.n_aux].flatten(1), hidden[:, self.n_aux]
        return aux, final, bool(torch.isfinite(hidden).all())

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


def shared_server(
    cfg: Any, target_dir: Path, out_dir: Path, rank: int = 0, world: int = 1
) -> VllmProducer:
    """One vLLM extract server for every training rank: rank 0 starts it, the others attach
    to it (its address and key go to them over the process group, never to a log) and send
    their own requests; the connector writes every file in rank 0's folder, and the rank that
    asked reads and deletes it (one node: the folder is local to all of them)."""
    work = out_dir / "vllm-work"
    if world == 1:
        return VllmProducer(cfg, str(target_dir), work)
    import torch.distributed as dist

    producer, box = None, [None]
    try:
        if rank == 0:
            producer = VllmProducer(cfg, str(target_dir), work / "rank0")
            s = producer.server.server
            box = [{"base_url": s.base_url, "model": s.model, "api_key": s.api_key}]
    finally:  # a failed start still reaches the other ranks (as None) instead of hanging them
        dist.broadcast_object_list(box, src=0)
    if box[0] is None:
        raise RuntimeError("rank 0 could not start the vLLM extract server (its log says why)")
    if producer is not None:
        return producer
    from eagle3.serving.server import Server

    attach = Server(box[0]["base_url"], box[0]["model"], "shared", False, api_key=box[0]["api_key"])
    return VllmProducer(cfg, str(target_dir), work / f"rank{rank}", attach=attach)


__all__ = [
    "HFProducer",
    "Job",
    "ProducerThread",
    "VllmProducer",
    "online_server_cfg",
    "shared_server",
]
