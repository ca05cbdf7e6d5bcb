"""Batches: padding, the target distributions, and the shift of TTT step i."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from eagle3.batching import packed_budget_batches, shuffled_budget_batches
from eagle3.train.target import TargetHead, target_distribution


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, L] int64, right padded with 0
    aux: torch.Tensor  # [B, L, A*Ht]
    probs: torch.Tensor  # [B, L, D]   P(f_u)
    target_arg: torch.Tensor  # [B, L]  draft index of argmax P_full(f_u), -1 outside / padding
    target_ok: torch.Tensor  # [B, L] bool: the target at u is counted (u+1 < len, m[u+1], in vocab)


def counted_positions(
    mask: torch.Tensor, arg: torch.Tensor, valid: torch.Tensor, positions: str = "predicted"
) -> torch.Tensor:
    """``target_ok`` [B, L]: the target at u (the distribution of token u+1) counts in the loss.

    ``predicted`` (ours): token u+1, the one predicted, carries the loss mask and the target's
    full-vocab argmax there is in the draft vocab. ``input`` (speculators'): token u carries it,
    with no vocab condition: one position later per answer (it skips predicting an answer's first
    token and predicts the token after its last), the positions bench/reference_grad_match.py
    compares gradients at."""
    ok = torch.zeros_like(mask)
    if positions == "input":
        ok[:, 1:] = mask[:, 1:] & valid[:, 1:]
    elif positions == "predicted":
        ok[:, :-1] = mask[:, 1:] & (arg[:, :-1] >= 0)
    else:
        raise ValueError(f"unknown loss positions {positions!r} (predicted or input)")
    return ok


def make_batch(
    samples: list,
    head: TargetHead,
    device: torch.device,
    max_seq_len: int,
    chunk: int = 256,
    positions: str = "predicted",
) -> Batch:
    """Pad samples (right) to the longest; target distributions computed per sample, chunked."""
    samples = [s for s in samples]
    lens = [min(len(s), max_seq_len) for s in samples]
    b, L = len(samples), max(lens)
    d = head.draft_ids.numel()
    ids = torch.zeros(b, L, dtype=torch.int64, device=device)
    aux = torch.zeros(b, L, samples[0].aux.shape[-1], dtype=torch.float32, device=device)
    probs = torch.zeros(b, L, d, dtype=torch.float32, device=device)
    arg = torch.full((b, L), -1, dtype=torch.int64, device=device)
    mask = torch.zeros(b, L, dtype=torch.bool, device=device)
    valid = torch.zeros(b, L, dtype=torch.bool, device=device)
    for j, (s, n) in enumerate(zip(samples, lens)):
        ids[j, :n] = s.input_ids[:n].to(device)
        aux[j, :n] = s.aux[:n].to(device, torch.float32)
        p, a = target_distribution(s.final[:n].to(device), head, chunk)
        probs[j, :n], arg[j, :n] = p, a
        mask[j, :n] = s.loss_mask[:n].to(device).bool()
        valid[j, :n] = True
    return Batch(ids, aux, probs, arg, counted_positions(mask, arg, valid, positions))


@dataclass
class Padded:
    """Samples zero-padded (right) on the host to the longest: what the fast step copies to the
    device in one go. Pinned when it goes to a GPU, so the copies do not block the host."""

    ids: torch.Tensor  # [B, L] int64
    mask: torch.Tensor  # [B, L] bool
    aux: torch.Tensor  # [B, L, A*Ht] the samples' dtype
    final: torch.Tensor  # [B, L, Ht]
    valid: torch.Tensor  # [B, L] bool
    lens: list[int]

    def to(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """(ids, mask, aux, final, valid) on ``device``; non-blocking from pinned memory."""
        pinned = self.ids.is_pinned()
        return tuple(
            x.to(device, non_blocking=pinned)
            for x in (self.ids, self.mask, self.aux, self.final, self.valid)
        )


def pad_samples(samples: list, max_seq_len: int, pin: bool) -> Padded:
    """Host work of a fast batch (any thread): each sample cut to ``max_seq_len`` and copied into
    zeroed [B, L(, .)] buffers, pinned if ``pin`` (pageable memory would make the copy block)."""
    lens = [min(len(s), max_seq_len) for s in samples]
    b, L = len(samples), max(lens)
    a0, f0 = samples[0].aux, samples[0].final
    ids = torch.zeros(b, L, dtype=torch.int64, pin_memory=pin)
    mask = torch.zeros(b, L, dtype=torch.bool, pin_memory=pin)
    aux = torch.zeros(b, L, a0.shape[-1], dtype=a0.dtype, pin_memory=pin)
    final = torch.zeros(b, L, f0.shape[-1], dtype=f0.dtype, pin_memory=pin)
    valid = torch.zeros(b, L, dtype=torch.bool, pin_memory=pin)
    for j, (s, n) in enumerate(zip(samples, lens)):
        valid[j, :n] = True
        ids[j, :n] = s.input_ids[:n]
        mask[j, :n] = s.loss_mask[:n].bool()
        aux[j, :n] = s.aux[:n]
        final[j, :n] = s.final[:n]
    return Padded(ids, mask, aux, final, valid, lens)


def make_batch_fast(
    samples: list,
    head: TargetHead,
    device: torch.device,
    max_seq_len: int,
    chunk: int = 1024,
    positions: str = "predicted",
    arg: torch.Tensor | None = None,
) -> Batch:
    """:func:`make_batch` for the fast step: padded on the host (pinned on CUDA), copied once
    without blocking, the target distribution of all rows in one chunked pass, no host sync.

    On CUDA the aux states stay bf16 (the fc reads them under bf16 autocast anyway: the same
    values as float32 cast there). Padding rows get a distribution too (they count nothing).
    ``arg``: the batch's target argmax [B, L] from an earlier batch of the same samples (only
    the draft rows of the target head run)."""
    pin = device.type == "cuda" and torch.cuda.is_available()
    ids, mask, aux, final, valid = pad_samples(samples, max_seq_len, pin).to(device)
    return batch_from_padded(ids, mask, aux, final, valid, head, chunk, positions, arg)


def batch_from_padded(
    ids: torch.Tensor,
    mask: torch.Tensor,
    aux: torch.Tensor,
    final: torch.Tensor,
    valid: torch.Tensor,
    head: TargetHead,
    chunk: int,
    positions: str,
    arg: torch.Tensor | None = None,
) -> Batch:
    """The batch of zero-padded [B, L(, .)] tensors already on the device (the fast step's and
    :mod:`eagle3.train.device_data`'s): aux in bf16 on CUDA (the fc reads it under bf16
    autocast anyway) else float32, the target distribution of all rows in one chunked pass
    (padding rows get one too; they count nothing). ``arg`` [B, L], when known: the target's
    argmax as a draft index, so only the draft rows of the target head run."""
    b, L = ids.shape
    aux = aux.to(torch.bfloat16 if ids.is_cuda else torch.float32)
    p, a = target_distribution(
        final.view(b * L, -1), head, chunk, None if arg is None else arg.reshape(-1)
    )
    arg = torch.where(valid, a.view(b, L), -1)
    return Batch(ids, aux, p.view(b, L, -1), arg, counted_positions(mask, arg, valid, positions))


def add_feature_noise(batch: Batch, std: float) -> None:
    """In place: Gaussian noise of ``std`` x each row's RMS on the target's aux states (EAGLE's
    feature noise: the draft meets its own imperfect states at inference)."""
    aux = batch.aux.float()
    rms = aux.pow(2).mean(-1, keepdim=True).sqrt()
    batch.aux.copy_(aux + torch.randn_like(aux) * rms * std)


def zero_weight(batch: Batch) -> Batch:
    """The same batch counting nothing: a rank's stand-in when the epoch's last group is short."""
    return dataclasses.replace(batch, target_ok=torch.zeros_like(batch.target_ok))


def shift_left(x: torch.Tensor, k: int, fill: Any = 0) -> torch.Tensor:
    """y[:, t] = x[:, t+k] (fill beyond the end), along dim 1."""
    if k == 0:
        return x
    y = torch.full_like(x, fill)
    if k < x.shape[1]:
        y[:, : x.shape[1] - k] = x[:, k:]
    return y


def step_inputs(
    batch: Batch, i: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """TTT step i's (input ids x_{t+1+i}, target probs P(f_{t+1+i}), target argmax, counted)."""
    k = 1 + i
    return (
        shift_left(batch.input_ids, k),
        shift_left(batch.probs, k),
        shift_left(batch.target_arg, k, -1),
        shift_left(batch.target_ok, k, False),
    )


def epoch_batches(
    ds: Any, token_budget: int, seed: int, epoch: int, batching: str = "fixed"
) -> list[list[int]]:
    """The epoch's batches (sample indices) of ``train.batching``, drawn by (seed, epoch):
    length buckets, the same every epoch (``fixed``) or new ones (``shuffled``), or random
    documents up to the budget in real tokens (``packed``: a packed row's statistics)."""
    seed = seed * 100003 + epoch
    if batching == "fixed":
        return list(ds.batches(token_budget, shuffle=True, seed=seed))
    lengths = [ds.length(i) for i in range(len(ds))]
    cut = shuffled_budget_batches if batching == "shuffled" else packed_budget_batches
    return cut(lengths, token_budget, seed)
