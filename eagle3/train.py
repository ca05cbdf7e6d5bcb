"""Train stage: the EAGLE-3 draft on stored target hidden states (nanoGPT style, one file).

One process, or N under torchrun (DDP or FSDP, see "Distributed" below); nothing global (all state
lives in :class:`TrainState`, the model and the optimizer).

Target side (the target model is never loaded): its final norm weight and its lm_head (tied:
embed_tokens) are read tensor by tensor from the checkpoint. For each stored token u the target
distribution is ``softmax(lm_head(rmsnorm(final[u])))`` restricted to the draft-vocab rows and
renormalised, computed in chunks of ``chunk`` tokens (full-vocab logits exist only for one chunk,
only to find the target's argmax; a position whose argmax is outside the draft vocab is masked).

Alignment (the exact shift; ``x`` = input_ids, ``a`` = aux, ``f`` = final, ``m`` = loss_mask of
one sample of length T; ``P(f_u)`` = target distribution from ``f_u``, i.e. over token u+1)::

    TTT step i (i = 0..K-1), draft position t (t = 0..T-1):
        hidden input   step 0: fc(a_t);  step i>0: out_{i-1}[t]   (the previous step's pre-norm out)
        input token    x_{t+1+i}                                   (0 when t+1+i >= T, masked anyway)
        RoPE position  t + i                                       (as vLLM's proposer: +1 per step)
        target         P(f_{t+1+i})                                (the distribution of token t+2+i)
        counted iff    t+2+i < T  and  m[t+2+i]  and  argmax P_full(f_{t+1+i}) in the draft vocab

So at step 0 the draft pairs the state at t with the token the target emitted after it (t+1) and
predicts the target's next-token distribution at t+1; each further step moves one position
further along the ground-truth tokens (SpecForge-style) while feeding its own hidden state.

TTT attention at step i (keys = [step-0 block, step-1 block, ..., step-i block], T each):
query t sees step-0 keys s <= t (causal) and, in each block 1..i, only key t (the diagonal),
which is what the draft sees at inference (the prefix, then its own chain of guesses).

Loss per step: soft cross-entropy ``-sum_d P_d log q_d`` averaged over the counted positions of the
batch; total = ``sum_i ttt_decay**i * loss_i``. Top-1 per step: draft argmax == target argmax
over the same positions (the acceptance proxy).

Checkpoints (``out_dir/checkpoints/latest``): ``model.safetensors`` (trainable weights),
``optimizer.safetensors`` (AdamW moments and step counts, flattened as ``state.<param>.<key>``),
``rng.safetensors`` (torch CPU/CUDA generator states) and ``state.json`` (TrainState, param groups,
python RNG state, config). No pickle anywhere. The LR schedule is a pure function of the step, so
the step counter is the scheduler state. Batch order is a function of (seed, epoch), so resume
skips the batches of the current epoch already done.

Distributed (``torchrun --nproc-per-node N``, detected from ``WORLD_SIZE``; nccl on CUDA, gloo on
CPU). One optimizer step consumes a global batch of G = N x ``grad_accum`` consecutive batches of
the epoch's order, which every rank computes alike from (seed, epoch); rank r takes batches r,
r+N, ... of the group. The epoch's last group may be short: a rank left without a batch runs a
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
import copy
import dataclasses
import json
import math
import os
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from eagle3.errors import MissingSamples, NoResult
from eagle3.extract.storage import HiddenStateDataset
from eagle3.generate.storage import write_json_atomic
from eagle3.model import (
    DraftConfig,
    Eagle3Draft,
    build_draft,
    checkpoint_dir,
    load_target_embeddings,
    load_target_tensor,
)
from eagle3.serving.gpus import release_gpus
from eagle3.vocab import load_vocab

NORM_NAMES = (
    "model.norm.weight",
    "language_model.model.norm.weight",
    "model.language_model.norm.weight",
    "norm.weight",
)
MAX_CONSECUTIVE_NAN = 5
# A run where fewer than this fraction of the optimizer steps were finite is not a trained draft:
# it fails and exports nothing (2 steps, both NaN, used to be sealed as done: issue #16).
MIN_FINITE_FRACTION = 0.5


class TrainingDiverged(NoResult, RuntimeError):
    """Too many non-finite steps in a row, or too few finite steps in all: nothing is exported."""


# ---------------------------------------------------------------------------------------------
# Target side
# ---------------------------------------------------------------------------------------------


@dataclass
class TargetHead:
    """What the target distribution needs: final norm, lm_head, and the draft vocab."""

    norm_weight: torch.Tensor  # [H]
    lm_head: torch.Tensor  # [V, H]
    draft_ids: torch.Tensor  # [D] target ids of the draft rows (ascending)
    t2draft: torch.Tensor  # [V] int64: draft index of a target id, -1 if not in the draft vocab
    eps: float

    def to(self, device: torch.device | str) -> "TargetHead":
        return TargetHead(self.norm_weight.to(device), self.lm_head.to(device), self.draft_ids.to(device),
                          self.t2draft.to(device), self.eps)


def load_target_head(target_dir: str | Path, draft_ids: torch.Tensor, eps: float) -> TargetHead:
    """Final norm + lm_head of the target read from its checkpoint (one tensor each)."""
    norm = load_target_tensor(target_dir, NORM_NAMES)
    _, head = load_target_embeddings(target_dir)
    draft_ids = draft_ids.to(torch.int64)
    t2draft = torch.full((head.shape[0],), -1, dtype=torch.int64)
    t2draft[draft_ids] = torch.arange(draft_ids.numel())
    return TargetHead(norm, head, draft_ids, t2draft, eps)


@torch.no_grad()
def target_distribution(final: torch.Tensor, head: TargetHead, chunk: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """For final states [N, H]: (probs [N, D] float32 over the draft vocab, renormalised;
    target argmax as a draft index [N], -1 where the full-vocab argmax is outside the draft vocab).

    Full-vocab logits exist only for ``chunk`` rows at a time."""
    n = final.shape[0]
    probs = torch.empty(n, head.draft_ids.numel(), dtype=torch.float32, device=final.device)
    arg = torch.empty(n, dtype=torch.int64, device=final.device)
    w = head.norm_weight.float()
    for a in range(0, n, chunk):
        x = final[a : a + chunk].float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + head.eps) * w
        logits = (x.to(head.lm_head.dtype) @ head.lm_head.T).float()  # [c, V]
        arg[a : a + chunk] = head.t2draft[logits.argmax(-1)]
        probs[a : a + chunk] = torch.softmax(logits[:, head.draft_ids], dim=-1)
    return probs, arg


# ---------------------------------------------------------------------------------------------
# Batches: padding and the shift
# ---------------------------------------------------------------------------------------------


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, L] int64, right padded with 0
    aux: torch.Tensor  # [B, L, A*Ht]
    probs: torch.Tensor  # [B, L, D]   P(f_u)
    target_arg: torch.Tensor  # [B, L]  draft index of argmax P_full(f_u), -1 outside / padding
    target_ok: torch.Tensor  # [B, L] bool: the target at u is counted (u+1 < len, m[u+1], in vocab)


def make_batch(samples: list, head: TargetHead, device: torch.device, max_seq_len: int, chunk: int = 256) -> Batch:
    """Pad samples (right) to the longest; target distributions computed per sample, chunked."""
    samples = [s for s in samples]
    lens = [min(len(s), max_seq_len) for s in samples]
    b, L = len(samples), max(lens)
    d = head.draft_ids.numel()
    ids = torch.zeros(b, L, dtype=torch.int64, device=device)
    aux = torch.zeros(b, L, samples[0].aux.shape[-1], dtype=torch.float32, device=device)
    probs = torch.zeros(b, L, d, dtype=torch.float32, device=device)
    arg = torch.full((b, L), -1, dtype=torch.int64, device=device)
    ok = torch.zeros(b, L, dtype=torch.bool, device=device)
    for j, (s, n) in enumerate(zip(samples, lens)):
        ids[j, :n] = s.input_ids[:n].to(device)
        aux[j, :n] = s.aux[:n].to(device, torch.float32)
        p, a = target_distribution(s.final[:n].to(device), head, chunk)
        probs[j, :n], arg[j, :n] = p, a
        m = s.loss_mask[:n].to(device).bool()
        ok[j, : n - 1] = m[1:n] & (a[: n - 1] >= 0)  # target at u counts iff token u+1 carries loss
    return Batch(ids, aux, probs, arg, ok)


def init_head_from_target(model: nn.Module, target_dir: str | Path, draft_ids: torch.Tensor) -> None:
    """Start the draft's read-out as the target's own: ``lm_head`` rows = the target's lm_head rows
    of the draft vocab (tied targets: embedding rows), final ``norm`` = the target's final norm.

    Why: the draft's last hidden state is trained to predict what the target's final state
    predicts, through the same kind of RMSNorm + linear read-out. A random 32000 x H read-out
    (most of the draft's trainable weights) has to be learnt from the data; the target's is
    already right for every token, including the ones the data shows rarely."""
    _, head = load_target_embeddings(target_dir)
    norm = load_target_tensor(target_dir, NORM_NAMES)
    ids = draft_ids.to(torch.int64)
    if head.shape[1] != model.lm_head.weight.shape[1] or norm.shape != model.norm.weight.shape:
        raise ValueError(f"train.head_init=target needs the draft's hidden size ({model.lm_head.weight.shape[1]}) "
                         f"to equal the target's ({head.shape[1]}); set train.head_init=random")
    with torch.no_grad():
        model.lm_head.weight.copy_(head[ids].to(model.lm_head.weight.dtype))
        model.norm.weight.copy_(norm.to(model.norm.weight.dtype))


def add_feature_noise(batch: Batch, std: float) -> None:
    """In place: Gaussian noise of ``std`` x each row's RMS on the target's aux states (EAGLE's
    feature noise: the draft meets its own imperfect states at inference)."""
    rms = batch.aux.pow(2).mean(-1, keepdim=True).sqrt()
    batch.aux.add_(torch.randn_like(batch.aux) * rms * std)


def shift_left(x: torch.Tensor, k: int, fill: Any = 0) -> torch.Tensor:
    """y[:, t] = x[:, t+k] (fill beyond the end), along dim 1."""
    if k == 0:
        return x
    y = torch.full_like(x, fill)
    if k < x.shape[1]:
        y[:, : x.shape[1] - k] = x[:, k:]
    return y


def step_inputs(batch: Batch, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input ids x_{t+1+i}, target probs P(f_{t+1+i}), target argmax, counted mask) of TTT step i."""
    k = 1 + i
    return (shift_left(batch.input_ids, k), shift_left(batch.probs, k), shift_left(batch.target_arg, k, -1),
            shift_left(batch.target_ok, k, False))


def ttt_mask(t: int, step: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Boolean [T, (step+1)*T]: causal over the step-0 block, the diagonal over blocks 1..step."""
    causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    eye = torch.eye(t, dtype=torch.bool, device=device)
    return torch.cat([causal] + [eye] * step, dim=1)


# ---------------------------------------------------------------------------------------------
# The TTT loss
# ---------------------------------------------------------------------------------------------


def ttt_unroll(model: Eagle3Draft, batch: Batch, ttt_steps: int):
    """Yield (step i, out [B, L, H], logits [B, L, D]) of the unrolled draft, step by step.

    Step i gets ``past_kv`` = keys/values of steps 0..i-1 (with grad), the boolean
    :func:`ttt_mask`, RoPE positions ``t + i`` and the ids of :func:`step_inputs`."""
    L = batch.input_ids.shape[1]
    device = batch.input_ids.device
    pos = torch.arange(L, device=device)
    hidden: torch.Tensor = batch.aux
    past: tuple[torch.Tensor, torch.Tensor] | None = None
    for i in range(ttt_steps):
        ids = shift_left(batch.input_ids, 1 + i)
        mask = None if i == 0 else ttt_mask(L, i, device)
        out, logits, kv = model(ids, hidden, position_ids=pos + i, attn_mask=mask, past_kv=past, use_cache=True)
        yield i, out, logits
        past = kv if past is None else (torch.cat([past[0], kv[0]], 2), torch.cat([past[1], kv[1]], 2))
        hidden = out


def step_counts(batch: Batch, ttt_steps: int) -> torch.Tensor:
    """Counted positions of each TTT step, int64 [ttt_steps] (known before the forward)."""
    return torch.stack([shift_left(batch.target_ok, 1 + i, False).sum() for i in range(ttt_steps)])


def ttt_loss(model: Eagle3Draft, batch: Batch, ttt_steps: int, ttt_decay: float,
             denom: torch.Tensor | None = None) -> tuple[torch.Tensor, list[dict]]:
    """Unrolled loss (weighted sum over steps) and per-step {loss, sum, correct, count}.

    Step i's loss is its summed soft CE over counted positions divided by ``denom[i]``, by default
    this batch's count; accumulation and distributed steps pass the count of the whole global
    batch so that the micro-batches' losses add up to the global batch's loss."""
    total = torch.zeros((), device=batch.input_ids.device)
    stats = []
    for i, out, logits in ttt_unroll(model, batch, ttt_steps):
        _, probs, arg, ok = step_inputs(batch, i)
        logp = torch.log_softmax(logits.float(), dim=-1)
        ce = -(probs * logp).sum(-1)  # [B, L]
        count = int(ok.sum())
        ce_sum = (ce * ok.float()).sum()
        loss_i = ce_sum / (max(count, 1) if denom is None else denom[i])
        total = total + (ttt_decay**i) * loss_i
        with torch.no_grad():
            correct = int(((logits.argmax(-1) == arg) & ok).sum())
        stats.append({"loss": float(loss_i.detach()), "sum": float(ce_sum.detach()), "correct": correct,
                      "count": count})
    return total, stats


class TTTObjective(nn.Module):
    """The draft and its TTT loss as one module, so that one ``forward`` is one training forward.

    The unroll calls the draft ``ttt_steps`` times; DDP and FSDP expect their root module to run
    once per backward, so they wrap this instead of the draft (the draft is ``.draft``)."""

    def __init__(self, draft: Eagle3Draft, ttt_steps: int, ttt_decay: float) -> None:
        super().__init__()
        self.draft = draft
        self.ttt_steps = ttt_steps
        self.ttt_decay = ttt_decay

    def forward(self, batch: Batch, denom: torch.Tensor | None = None) -> tuple[torch.Tensor, list[dict]]:
        return ttt_loss(self.draft, batch, self.ttt_steps, self.ttt_decay, denom)


# ---------------------------------------------------------------------------------------------
# Distributed: torchrun, DDP / FSDP, one training step
# ---------------------------------------------------------------------------------------------


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
    ``WORLD_SIZE=1`` (set by some schedulers) is a plain process. ``torchrun --nproc-per-node 1`` gives a
    one-rank DDP/FSDP run (the same wrapping, e.g. as the 1-GPU baseline of a scaling
    measurement). A process group someone else initialised (a launcher script, a test) is used
    and left alone."""
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1 or "TORCHELASTIC_RUN_ID" in os.environ  # torchrun
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


def wrap_for_training(draft: Eagle3Draft, d: Dist, dev: torch.device, ttt_steps: int, ttt_decay: float) -> nn.Module:
    """:class:`TTTObjective` around the draft, under DDP or FSDP unless ``d.mode == "single"``.

    Frozen parameters (the target's embedding) take no part in either: DDP is told to ignore
    them (no start-up broadcast of 2.35 GB; they have no grads to all-reduce anyway), and the
    buffers (RoPE tables, computed alike on every rank) too, so it syncs none; FSDP gets
    them as ``ignored_params``, so every rank keeps a whole replicated copy and looks rows up
    locally. FSDP (FSDP2 ``fully_shard``) is one unit over all trainable weights: the TTT unroll
    uses every weight in each of its steps, so they stay gathered through forward and backward
    whichever way they are grouped; what is sharded is the fp32 master weights, the gradients after
    the reduce-scatter and AdamW's moments. Every rank builds the same initial weights (same seed).
    Build the optimizer after this (FSDP replaces the parameters by sharded ones)."""
    net = TTTObjective(draft, ttt_steps, ttt_decay)
    if d.mode == "single":
        return net
    if d.mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ignore = [n for n, p in net.named_parameters() if not p.requires_grad] + [n for n, _ in net.named_buffers()]
        DDP._set_params_and_buffers_to_ignore_for_model(net, ignore)
        # gradients as views into DDP's buckets: no second fp32 copy of them (3.8 GB for Kimi)
        return DDP(net, device_ids=[dev.index] if dev.type == "cuda" else None, gradient_as_bucket_view=True)
    if d.mode == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(dev.type, (d.world,))
        fully_shard(net, mesh=mesh, ignored_params={p for p in net.parameters() if not p.requires_grad})
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


def _grad_sync(net: nn.Module, d: Dist, sync: bool) -> contextlib.AbstractContextManager:
    """Accumulation: only the last micro-batch's backward all-reduces / reduce-scatters."""
    if d.mode == "fsdp":
        net.set_requires_gradient_sync(sync)  # type: ignore[operator]
    elif d.mode == "ddp" and not sync:
        return net.no_sync()  # type: ignore[operator]
    return contextlib.nullcontext()


def zero_weight(batch: Batch) -> Batch:
    """The same batch counting nothing: a rank's stand-in when the epoch's last group is short."""
    return dataclasses.replace(batch, target_ok=torch.zeros_like(batch.target_ok))


@dataclass
class StepResult:
    loss: float  # global weighted TTT loss (nan/inf: the step was skipped)
    stats: list[dict]  # global, per TTT step: {loss, correct, count}
    grad_norm: float
    finite: bool  # the optimizer stepped


def train_step(net: nn.Module, opt: torch.optim.Optimizer, params: list[torch.Tensor], micro: list[Batch], d: Dist,
               ttt_steps: int, ttt_decay: float, grad_clip: float,
               autocast: contextlib.AbstractContextManager) -> StepResult:
    """One optimizer step on this rank's micro-batches; the global batch is all ranks' together.

    The per-step denominators (counted positions of the global batch) are all-reduced first, so
    each micro-batch's loss is its exact share of the global loss; x ``d.world`` undoes DDP's /
    FSDP's gradient averaging. A non-finite loss or gradient norm anywhere skips the step on every
    rank alike (the all-reduced sums and the norm of the all-reduced gradients are the same on all)."""
    counts = sum(step_counts(b, ttt_steps) for b in micro)
    if d.world > 1:
        dist.all_reduce(counts)
    denom = counts.clamp(min=1).float()
    sums = torch.zeros(3, ttt_steps, dtype=torch.float64, device=counts.device)  # ce sum, correct, count
    for j, b in enumerate(micro):
        with _grad_sync(net, d, j == len(micro) - 1):
            with autocast:
                loss, stats = net(b, denom)
            (loss * d.world).backward()
        sums += torch.tensor([[s["sum"] for s in stats], [s["correct"] for s in stats], [s["count"] for s in stats]],
                             dtype=torch.float64, device=sums.device)
    if d.world > 1:
        dist.all_reduce(sums)
    per_step = [{"loss": float(sums[0, i] / max(float(sums[2, i]), 1.0)), "correct": int(sums[1, i]),
                 "count": int(sums[2, i])} for i in range(ttt_steps)]
    total = sum(ttt_decay**i * s["loss"] for i, s in enumerate(per_step))
    gnorm_t = torch.nn.utils.clip_grad_norm_(params, grad_clip)
    gnorm = float(gnorm_t.full_tensor() if isinstance(gnorm_t, DTensor) else gnorm_t)
    finite = math.isfinite(total) and math.isfinite(gnorm)
    if finite:
        opt.step()
    opt.zero_grad(set_to_none=True)
    return StepResult(total, per_step, gnorm, finite)


def _full(t: torch.Tensor, keep: bool) -> torch.Tensor | None:
    """A whole tensor on CPU where ``keep`` (rank 0), from a plain or an FSDP-sharded one. Sharded
    tensors are all-gathered, so every rank must call this for them, in the same order."""
    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.detach().cpu().contiguous() if keep else None


def _like(full: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """``full`` laid out like ``ref``: this rank's shard if ``ref`` is sharded (every rank holds
    the whole tensor, read from the checkpoint, so no communication)."""
    if isinstance(ref, DTensor):
        return distribute_tensor(full.to(ref.device), ref.device_mesh, ref.placements, src_data_rank=None)
    return full


# ---------------------------------------------------------------------------------------------
# Schedule, state, checkpoints
# ---------------------------------------------------------------------------------------------


def lr_at(step: int, total: int, base_lr: float, warmup_ratio: float) -> float:
    """Linear warmup then cosine to 0; a pure function of the step (the scheduler's state)."""
    warmup = int(warmup_ratio * total)
    if step < warmup:
        return base_lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return base_lr * 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


@dataclass
class TrainState:
    epoch: int = 0  # current epoch (0-based)
    batch_in_epoch: int = 0  # batches of this epoch already consumed
    step: int = 0  # optimizer steps overall (the schedule position), skipped ones included
    updates: int = 0  # optimizer updates done
    skipped_nan: int = 0
    consecutive_nan: int = 0
    # running sums of the current epoch: per TTT step loss*count, correct, count
    epoch_sums: dict[str, list[float]] = field(default_factory=dict)
    history: list[dict] = field(default_factory=list)  # per finished epoch metrics


def make_optimizer(model: Eagle3Draft, lr: float, weight_decay: float) -> torch.optim.AdamW:
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = [p for n, p in params if p.dim() >= 2]
    no_decay = [p for n, p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))


def _optimizer_to_flat(opt: torch.optim.Optimizer, keep: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``state.<param index>.<key>`` tensors (whole, gathered from FSDP shards) + param groups."""
    sd = opt.state_dict()
    tensors = {}
    for idx, st in sd["state"].items():
        for k, v in st.items():
            full = _full(v if torch.is_tensor(v) else torch.tensor(v), keep)
            if keep:
                tensors[f"state.{idx}.{k}"] = full
    return tensors, {"param_groups": sd["param_groups"]}


def _optimizer_from_flat(opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    params = [p for g in opt.param_groups for p in g["params"]]  # the indices of opt.state_dict()
    state: dict[int, dict[str, torch.Tensor]] = {}
    for name, v in tensors.items():
        _, idx, k = name.split(".", 2)
        ref = params[int(idx)]
        state.setdefault(int(idx), {})[k] = _like(v, ref) if v.shape == ref.shape else v
    opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def _rng_state() -> tuple[dict[str, torch.Tensor], Any]:
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{i}"] = s
    v, internal, gauss = random.getstate()
    return tensors, [v, list(internal), gauss]


def _set_rng_state(tensors: dict[str, torch.Tensor], py: Any) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    if torch.cuda.is_available():
        states = [tensors[k] for k in sorted(k for k in tensors if k.startswith("torch_cuda_"))]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)
    random.setstate((py[0], tuple(py[1]), py[2]))


def _trainable_full(model: Eagle3Draft, keep: bool) -> dict[str, torch.Tensor]:
    """The trainable weights, whole, on CPU where ``keep`` (FSDP shards gathered)."""
    out = {}
    for k, v in model.trainable_state_dict().items():
        full = _full(v, keep)
        if keep:
            out[k] = full
    return out


def save_checkpoint(ckpt_dir: Path, model: Eagle3Draft, opt: torch.optim.Optimizer, state: TrainState,
                    extra: dict[str, Any], *, write: bool = True, sharded: bool = False) -> Path:
    """Atomically (tmp folder + rename) replace ``ckpt_dir`` with the current state.

    Distributed: called on every rank; only ``write`` (rank 0) writes. With ``sharded`` (FSDP)
    every rank takes part in gathering the whole weights and optimizer state first; the files are
    the single-process ones either way."""
    ckpt_dir = Path(ckpt_dir)
    if not (write or sharded):
        return ckpt_dir
    weights = _trainable_full(model, write)
    opt_t, opt_meta = _optimizer_to_flat(opt, write)
    if not write:
        return ckpt_dir
    tmp = ckpt_dir.with_name(ckpt_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(weights, str(tmp / "model.safetensors"))
    save_file(opt_t, str(tmp / "optimizer.safetensors"))
    rng_t, py_rng = _rng_state()
    save_file(rng_t, str(tmp / "rng.safetensors"))
    (tmp / "state.json").write_text(json.dumps({"state": asdict(state), "optimizer": opt_meta,
                                                "python_rng": py_rng, **extra}, indent=1))
    old = ckpt_dir.with_name(ckpt_dir.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if ckpt_dir.exists():
        ckpt_dir.rename(old)
    tmp.rename(ckpt_dir)
    shutil.rmtree(old, ignore_errors=True)
    return ckpt_dir


def load_checkpoint(ckpt_dir: Path, model: Eagle3Draft, opt: torch.optim.Optimizer) -> tuple[TrainState, dict]:
    """Every rank reads the whole files; FSDP ranks keep their shards (:func:`_like`)."""
    ckpt_dir = Path(ckpt_dir)
    meta = json.loads((ckpt_dir / "state.json").read_text())
    device = next(model.parameters()).device
    weights = load_file(str(ckpt_dir / "model.safetensors"), device=str(device))
    params = dict(model.named_parameters())
    weights = {k: _like(v, params[k]) if k in params else v for k, v in weights.items()}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    missing = [m for m in missing if not m.startswith("embed_tokens.")]
    if missing or unexpected:
        raise ValueError(f"{ckpt_dir}: checkpoint does not fit the draft: missing {missing}, unexpected {unexpected}")
    _optimizer_from_flat(opt, load_file(str(ckpt_dir / "optimizer.safetensors"), device=str(device)),
                         meta["optimizer"])
    _set_rng_state(load_file(str(ckpt_dir / "rng.safetensors")), meta["python_rng"])
    return TrainState(**meta["state"]), meta


# ---------------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------------


def _accumulate(state: TrainState, stats: list[dict]) -> None:
    s = state.epoch_sums
    if not s:
        s.update(loss=[0.0] * len(stats), correct=[0.0] * len(stats), count=[0.0] * len(stats))
    for i, st in enumerate(stats):
        s["loss"][i] += st["loss"] * st["count"]
        s["correct"][i] += st["correct"]
        s["count"][i] += st["count"]


def _epoch_metrics(state: TrainState) -> dict[str, Any]:
    s = state.epoch_sums or {"loss": [], "correct": [], "count": []}
    return {
        "epoch": state.epoch + 1,
        "step": state.step,
        "loss": [l / c if c else None for l, c in zip(s["loss"], s["count"])],
        "top1": [k / c if c else None for k, c in zip(s["correct"], s["count"])],
        "tokens": s["count"][0] if s["count"] else 0,
        "skipped_nan": state.skipped_nan,
    }


def write_metrics(out_dir: Path, history: list[dict]) -> None:
    (out_dir / "metrics.json").write_text(json.dumps({"epochs": history}, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not history:
        return
    n_steps = len(history[-1]["loss"])
    epochs = [h["epoch"] for h in history]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for i in range(n_steps):
        ax1.plot(epochs, [h["loss"][i] for h in history], marker="o", label=f"step {i}")
        ax2.plot(epochs, [h["top1"][i] for h in history], marker="o", label=f"step {i}")
    ax1.set(xlabel="epoch", ylabel="soft CE", title="loss per TTT step")
    ax2.set(xlabel="epoch", ylabel="top-1 agreement", title="top-1 per TTT step", ylim=(0, 1))
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "metrics.png", dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------


def check_finite(state: "TrainState", extract_dir: Path) -> None:
    """Refuse to export a draft that (almost) never took a finite step."""
    if state.step and state.updates >= MIN_FINITE_FRACTION * state.step and state.updates > 0:
        return
    raise TrainingDiverged(
        f"only {state.updates} of {state.step} optimizer steps were finite (at least {MIN_FINITE_FRACTION:.0%} are "
        f"required): the draft is not trained, nothing was exported or sealed. Check {extract_dir} for NaN/inf "
        "states (extract drops them) and train.lr, then rerun train (delete its checkpoints/ to start over)")


def _epoch_batches(ds: HiddenStateDataset, token_budget: int, seed: int, epoch: int) -> list[list[int]]:
    return list(ds.batches(token_budget, shuffle=True, seed=seed * 100003 + epoch))


def train(
    cfg: Any,
    extract_dir: str | Path,
    vocab_path: str | Path,
    target_dir: str | Path,
    out_dir: str | Path,
    on_progress: Callable[[dict[str, Any]], None] | None = None,
    *,
    max_steps: int | None = None,
    resume: bool = True,
    device: str | None = None,
) -> dict[str, Any]:
    """Train the draft and export it to ``out_dir/vllm-draft``; returns (and writes) the manifest.

    ``cfg`` is the PipelineConfig (``cfg.train``, ``cfg.aux_layers``). ``max_steps`` stops after
    that many optimizer steps overall (checkpointing first; the schedule still spans all epochs): a
    later call with ``resume=True`` continues exactly. ``on_progress`` gets a dict per step.

    Under torchrun (``WORLD_SIZE`` > 1) this runs on every rank with ``train.distributed`` (DDP or
    FSDP); rank 0 writes, reports progress and exports; every rank returns the manifest.
    """
    if os.environ.get("RANK", "0") == "0":  # before any rank touches a GPU (eagle3.serving.gpus)
        release_gpus(cfg, "train")
    target_dir = checkpoint_dir(target_dir)  # a hub id: its snapshot in the local cache
    d, dev = init_distributed(cfg.train.distributed, device)
    try:
        return _train(cfg, Path(extract_dir), Path(vocab_path), Path(target_dir), Path(out_dir), on_progress,
                      max_steps, resume, d, dev)
    finally:
        if d.owns_group:
            dist.destroy_process_group()


def _train(cfg: Any, extract_dir: Path, vocab_path: Path, target_dir: Path, out_dir: Path,
           on_progress: Callable[[dict[str, Any]], None] | None, max_steps: int | None, resume: bool, d: Dist,
           dev: torch.device) -> dict[str, Any]:
    tc = cfg.train
    if d.main:
        out_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()

    vocab = load_vocab(Path(vocab_path))
    ds = HiddenStateDataset(extract_dir, dtype=torch.float32)
    if len(ds) == 0:
        raise ValueError(f"{extract_dir}: no samples")
    aux_layers = list(cfg.aux_layers)
    man_path = extract_dir / "manifest.json"
    if man_path.is_file():
        extract_manifest = json.loads(man_path.read_text())
        stored = extract_manifest.get("aux_layers")
        if stored is not None and list(stored) != aux_layers:
            raise ValueError(f"extract stored aux layers {stored}, config says {aux_layers}")
        listed = extract_manifest.get("samples")
        if listed is not None and len(ds) < int(listed):
            raise MissingSamples(f"{extract_dir}: manifest.json lists {listed} samples, index.json {len(ds)}: the "
                                 "folder was changed after extract; rerun extract into it, then train")

    overrides = {k: v for k, v in {"num_attention_heads": tc.draft_num_attention_heads,
                                   "num_key_value_heads": tc.draft_num_key_value_heads,
                                   "intermediate_size": tc.draft_intermediate_size}.items() if v is not None}
    torch.manual_seed(tc.seed)
    random.seed(tc.seed)
    model = build_draft(target_dir, vocab.draft_vocab_size, aux_layers, arch=cfg.draft_arch, **overrides)
    dcfg: DraftConfig = model.config
    if vocab.target_vocab_size != dcfg.vocab_size:
        raise ValueError(f"vocab built for {vocab.target_vocab_size} target ids, target has {dcfg.vocab_size}")
    if ds[0].aux.shape[-1] != dcfg.fc_input_size:
        raise ValueError(f"stored aux width {ds[0].aux.shape[-1]} != {len(aux_layers)} x {dcfg.target_hidden_size}")
    if tc.head_init == "target":
        init_head_from_target(model, target_dir, vocab.draft_ids)
    if tc.freeze_head:
        for prm in (*model.lm_head.parameters(), *model.norm.parameters()):
            prm.requires_grad_(False)
    # FSDP shards the draft in place: rank 0 keeps an unsharded CPU copy (frozen tensors shared)
    # to load the gathered final weights into for the export.
    sharded = d.mode == "fsdp"
    export_copy = (copy.deepcopy(model, {id(p): p for p in model.parameters() if not p.requires_grad})
                   if sharded and d.main else None)
    model.to(dev)
    hold_frozen_bf16(model, dev)
    head = load_target_head(target_dir, vocab.draft_ids, dcfg.rms_norm_eps).to(dev)
    net = wrap_for_training(model, d, dev, tc.ttt_steps, tc.ttt_decay)
    opt = make_optimizer(model, tc.lr, tc.weight_decay)
    trainable = [p for p in model.parameters() if p.requires_grad]

    per_epoch = len(_epoch_batches(ds, tc.token_budget, tc.seed, 0))
    group = d.world * tc.grad_accum  # batches per optimizer step (the global batch)
    total_steps = math.ceil(per_epoch / group) * tc.epochs
    ckpt = out_dir / "checkpoints" / "latest"
    extra = {"total_steps": total_steps, "global_batches": group, "world_size": d.world,
             "train_config": tc.model_dump(mode="json"), "draft_config": dcfg.to_dict()}
    state = TrainState()
    resumed_from = None
    if resume and (ckpt / "state.json").is_file():
        state, meta = load_checkpoint(ckpt, model, opt)
        if meta.get("total_steps") != total_steps or meta.get("draft_config") != dcfg.to_dict():
            raise ValueError(f"{ckpt}: checkpoint from a different run (schedule or draft shape differs; a run "
                             f"of {meta.get('global_batches', 1)} batches per step resumes with world size x "
                             f"train.grad_accum = {meta.get('global_batches', 1)}, this one has {group})")
        resumed_from = state.step

    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else torch.autocast("cpu", enabled=False)
    save = dict(write=d.main, sharded=sharded)
    stopped_early = False
    model.train()
    while state.epoch < tc.epochs:
        batches = _epoch_batches(ds, tc.token_budget, tc.seed, state.epoch)
        while state.batch_in_epoch < len(batches):
            if max_steps is not None and state.step >= max_steps:
                stopped_early = True
                break
            step_batches = batches[state.batch_in_epoch : state.batch_in_epoch + group]
            mine = step_batches[d.rank :: d.world]  # up to grad_accum batches of this rank
            micro = [make_batch([ds[i] for i in idx], head, dev, tc.max_seq_len) for idx in mine]
            if tc.feature_noise > 0:
                for b in micro:
                    add_feature_noise(b, tc.feature_noise)
            if not micro:  # the epoch's short last group: join the all-reduce with nothing counted
                micro = [zero_weight(make_batch([ds[i] for i in step_batches[0]], head, dev, tc.max_seq_len))]
            lr = lr_at(state.step, total_steps, tc.lr, tc.warmup_ratio)
            for g in opt.param_groups:
                g["lr"] = lr
            r = train_step(net, opt, trainable, micro, d, tc.ttt_steps, tc.ttt_decay, tc.grad_clip, autocast)
            del micro
            if r.finite:
                state.updates += 1
                state.consecutive_nan = 0
                _accumulate(state, r.stats)
            else:
                state.skipped_nan += 1
                state.consecutive_nan += 1
            state.step += 1
            state.batch_in_epoch += len(step_batches)
            if state.consecutive_nan >= MAX_CONSECUTIVE_NAN:
                raise TrainingDiverged(f"{state.consecutive_nan} non-finite steps in a row (last at step "
                                       f"{state.step}, {state.skipped_nan} skipped in all): check the data / lr")
            if on_progress is not None and d.main:
                on_progress({"step": state.step, "total_steps": total_steps, "epoch": state.epoch, "lr": lr,
                             "loss": r.loss if r.finite else None, "grad_norm": r.grad_norm,
                             "steps": r.stats, "skipped_nan": state.skipped_nan})
            if state.step % tc.checkpoint_every_steps == 0:
                save_checkpoint(ckpt, model, opt, state, extra, **save)
        if stopped_early:
            break
        state.history.append(_epoch_metrics(state))
        state.epoch += 1
        state.batch_in_epoch = 0
        state.epoch_sums = {}
        if d.main:
            write_metrics(out_dir, state.history)
        save_checkpoint(ckpt, model, opt, state, extra, **save)

    if stopped_early:
        save_checkpoint(ckpt, model, opt, state, extra, **save)
        if d.world > 1:
            dist.barrier()
        return {"stage": "train", "complete": False, "step": state.step, "total_steps": total_steps,
                "checkpoint": str(ckpt)}

    check_finite(state, extract_dir)
    from eagle3.export import export_vllm

    if sharded:  # gather the final weights (every rank), load them into rank 0's unsharded copy
        final_weights = _trainable_full(model, d.main)
        if export_copy is not None:
            export_copy.load_state_dict(final_weights, strict=False)
            model = export_copy
    export_dir = out_dir / "vllm-draft"
    if d.main:
        model.eval()
        export_dir = export_vllm(model.to("cpu").float(), None, vocab.d2t, vocab.t2d, out_dir / "vllm-draft",
                                 metadata={"stage": "train", "steps": state.step, "epochs": tc.epochs})
    manifest = {
        "stage": "train",
        "complete": True,
        "target_dir": str(target_dir),
        "extract_dir": str(extract_dir),
        "vocab": str(vocab_path),
        "export": str(export_dir),
        "draft_config": dcfg.to_dict(),
        "train_config": tc.model_dump(mode="json"),
        "samples": len(ds),
        "steps": state.step,
        "updates": state.updates,
        "skipped_nan": state.skipped_nan,
        "total_steps": total_steps,
        "resumed_from_step": resumed_from,
        "final": state.history[-1] if state.history else None,
        "device": str(dev),
        "distributed": {"mode": d.mode, "world_size": d.world, "grad_accum": tc.grad_accum,
                        "batches_per_step": group},
        "wall_s": round(time.time() - started, 2),
    }
    if d.main:
        write_json_atomic(out_dir / "manifest.json", manifest)
    if d.world > 1:
        dist.barrier()  # the export and manifest exist when any rank returns
    return manifest


__all__ = [
    "Batch",
    "Dist",
    "StepResult",
    "TTTObjective",
    "TargetHead",
    "TrainState",
    "TrainingDiverged",
    "hold_frozen_bf16",
    "init_distributed",
    "load_target_head",
    "lr_at",
    "make_batch",
    "step_counts",
    "step_inputs",
    "target_distribution",
    "train",
    "train_step",
    "ttt_loss",
    "ttt_mask",
    "ttt_unroll",
    "wrap_for_training",
    "zero_weight",
]
