"""Distributed training: torchrun, the process group, DDP or FSDP around the TTT objective.

``torchrun --nproc-per-node N`` is detected from ``WORLD_SIZE`` (nccl on CUDA, gloo on CPU).
One optimizer step consumes a global batch of G = N x ``grad_accum`` consecutive batches of the
epoch's order, which every rank computes alike from (seed, epoch); rank r takes batches r, r+N,
... of the group. The epoch's last group may be short: a rank left without a batch runs a
zero-weight copy of the group's first one (no loss, no gradient, no metrics) so that it joins the
gradient all-reduce; nothing is dropped or counted twice. The loss of TTT step i is
``sum(ce over counted positions of all G batches) / (their count)``: the counts are all-reduced
before the forward, every rank's loss is its share times N (DDP and FSDP average gradients over
ranks), so the summed gradient is the single-process gradient of the same global batch (one
process with ``grad_accum = N`` runs exactly that schedule; tests/test_train_distributed.py).
Rank 0 alone writes checkpoints (the same files: FSDP's shards are gathered first), metrics and
the export; metrics are all-reduced first. The frozen embedding is never sharded (docs/train.md).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from eagle3.draft import DraftModel
from eagle3.train.ttt import TTTObjective


@dataclass
class Dist:
    """Where this process sits. ``mode == "single"``: a plain process, no process group."""

    rank: int = 0
    world: int = 1
    mode: str = "single"  # "single" | "ddp" | "fsdp"
    owns_group: bool = False  # init_distributed created the process group (and train destroys it)

    @property
    def main(self) -> bool:
        return self.rank == 0


def init_distributed(mode: str, device: str | None = None) -> tuple[Dist, torch.device]:
    """The process group (if started by torchrun) and this rank's device.

    Under torchrun (``WORLD_SIZE`` > 1 or ``TORCHELASTIC_RUN_ID`` set) a CUDA machine gives rank r
    ``cuda:LOCAL_RANK`` and nccl, otherwise (or with ``device="cpu"``) gloo on CPU. A bare
    ``WORLD_SIZE=1`` (set by some schedulers) is a plain process. ``torchrun --nproc-per-node 1``
    gives a
    one-rank DDP/FSDP run (the same wrapping, e.g. as the 1-GPU baseline of a scaling
    measurement). A process group someone else initialised (a launcher script, a test) is used
    and left alone."""
    launched = (
        int(os.environ.get("WORLD_SIZE", "1")) > 1 or "TORCHELASTIC_RUN_ID" in os.environ
    )  # torchrun
    if not launched and not (dist.is_available() and dist.is_initialized()):
        return Dist(), torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda":
        dev = torch.device("cuda", local_rank if dev.index is None else dev.index)
        torch.cuda.set_device(dev)
    owns = not dist.is_initialized()
    if owns:
        if dev.type == "cuda":
            dist.init_process_group("nccl", device_id=dev)
        else:
            dist.init_process_group("gloo")
    return Dist(dist.get_rank(), dist.get_world_size(), mode, owns), dev


def wrap_for_training(
    draft: DraftModel,
    d: Dist,
    dev: torch.device,
    ttt_steps: int,
    ttt_decay: float,
    impl: str = "eager",
    parallel: int = 0,
) -> nn.Module:
    """:class:`TTTObjective` around the draft, under DDP or FSDP unless ``d.mode == "single"``.

    Frozen parameters (the target's embedding) take no part in either: DDP is told to ignore
    them (no start-up broadcast of 2.35 GB; they have no grads to all-reduce anyway), and the
    buffers (RoPE tables, computed alike on every rank) too, so it syncs none; FSDP gets
    them as ``ignored_params``, so every rank keeps a whole replicated copy and looks rows up
    locally. FSDP (FSDP2 ``fully_shard``) is one unit over all trainable weights: the TTT unroll
    uses every weight in each of its steps, so they stay gathered through forward and backward
    whichever way they are grouped; what is sharded is the fp32 master weights, the gradients after
    the reduce-scatter and AdamW's moments. Every rank builds the same initial weights (same seed).
    Build the optimizer after this (FSDP replaces the parameters by sharded ones). ``impl``: the
    TTT step, ``eager`` (reference) or ``fast`` (:mod:`eagle3.train.ttt_fast`); ``parallel``: the
    parallel-drafting depths trained beside the TTT steps (:mod:`eagle3.train.ttt`)."""
    net = TTTObjective(draft, ttt_steps, ttt_decay, impl, parallel)
    if d.mode == "single":
        return net
    if d.mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ignore = [n for n, p in net.named_parameters() if not p.requires_grad] + [
            n for n, _ in net.named_buffers()
        ]
        DDP._set_params_and_buffers_to_ignore_for_model(net, ignore)
        # gradients as views into DDP's buckets: no second fp32 copy of them (3.8 GB for Kimi)
        return DDP(
            net,
            device_ids=[dev.index] if dev.type == "cuda" else None,
            gradient_as_bucket_view=True,
        )
    if d.mode == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(dev.type, (d.world,))
        fully_shard(
            net, mesh=mesh, ignored_params={p for p in net.parameters() if not p.requires_grad}
        )
        return net
    raise ValueError(f"train.distributed must be ddp or fsdp, got {d.mode!r}")


def hold_frozen_bf16(model: nn.Module, dev: torch.device) -> None:
    """On CUDA keep frozen parameters (the embedding) in bf16: under bf16 autocast the draft casts
    the looked-up rows to the bf16 hidden states anyway, so nothing changes numerically, and the
    Kimi embedding costs 2.35 GB per GPU instead of 4.7 (its checkpoint stores bf16)."""
    if dev.type != "cuda":
        return
    for p in model.parameters():
        if not p.requires_grad and p.is_floating_point():
            p.data = p.data.to(torch.bfloat16)


def grad_sync(net: nn.Module, d: Dist, sync: bool) -> contextlib.AbstractContextManager:
    """Accumulation: only the last micro-batch's backward all-reduces / reduce-scatters."""
    if d.mode == "fsdp":
        net.set_requires_gradient_sync(sync)  # type: ignore[operator]
    elif d.mode == "ddp" and not sync:
        return net.no_sync()  # type: ignore[operator]
    return contextlib.nullcontext()


def gather_full(t: torch.Tensor, keep: bool) -> torch.Tensor | None:
    """A whole tensor on CPU where ``keep`` (rank 0), from a plain or an FSDP-sharded one. Sharded
    tensors are all-gathered, so every rank must call this for them, in the same order."""
    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.detach().cpu().contiguous() if keep else None


def shard_like(full: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """``full`` laid out like ``ref``: this rank's shard if ``ref`` is sharded (every rank holds
    the whole tensor, read from the checkpoint, so no communication)."""
    if isinstance(ref, DTensor):
        return distribute_tensor(
            full.to(ref.device), ref.device_mesh, ref.placements, src_data_rank=None
        )
    return full
