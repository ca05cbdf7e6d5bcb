"""Every stored sample in the training device's memory, and batches cut from it there.

Why: a small draft is host-bound. With the samples read per step from the memory-mapped shards
(``ds[i]``: safetensors slices, a dtype cast, a padded pinned copy per sample), the SmolLM2 draft's
8,192-token steps took 0.41 s on an H200 whose kernels need ~20 ms of it (issue 15). An extract of
a small target fits in GPU memory many times over (9,780 ShareGPT samples at SmolLM2's 576 x 4
stored states: 22 GB in bf16 of the H200's 141), so it is read once, kept there in its storage
dtype, and each batch is one gather by an index built on the host: no per-sample work on the
host, no host-to-device copy of states in the step. :func:`fits` decides when this is used
(``train.data_on_device: auto``): on CUDA, when the states take at most a share of free memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from safetensors import safe_open

from eagle3.extract.storage import HiddenStateDataset, dequantize_fp8
from eagle3.train.batch import Batch, batch_from_padded
from eagle3.train.target import TargetHead, target_argmax

#: the share of free device memory the states may take under ``data_on_device: auto``
AUTO_SHARE = 0.35


def stored_bytes(ds: HiddenStateDataset, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of every sample's aux + final states in ``dtype`` (from the first sample's widths)."""
    s = ds[0]
    width = s.aux.shape[-1] + s.final.shape[-1]
    tokens = sum(ds.length(i) for i in range(len(ds)))
    return tokens * width * torch.tensor([], dtype=dtype).element_size()


def fits(ds: HiddenStateDataset, device: torch.device, share: float = AUTO_SHARE) -> bool:
    """Whether ``auto`` keeps the data on ``device``: CUDA only (on the CPU the shards are already
    memory-mapped in host memory), and at most ``share`` of its free memory."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    free, _ = torch.cuda.mem_get_info(device)
    return stored_bytes(ds) <= share * free


def _states(h, name: str) -> torch.Tensor:
    """A shard's whole states tensor in its storage dtype (fp8: dequantised to bf16)."""
    x = h.get_tensor(name)
    if h.metadata().get("storage_dtype") == "float8_e4m3fn":
        return dequantize_fp8(x, h.get_tensor(f"{name}_scale"), torch.bfloat16)
    return x


@dataclass
class DeviceData:
    """The samples of ``ds`` as flat tensors on one device; sample i is rows
    ``start[i] : start[i] + length[i]``."""

    input_ids: torch.Tensor  # [N] int64
    loss_mask: torch.Tensor  # [N] bool
    aux: torch.Tensor  # [N, A*Ht] storage dtype (bf16; fp8 shards dequantised to bf16)
    final: torch.Tensor  # [N, Ht]
    start: list[int]
    length: list[int]
    arg: torch.Tensor | None = None  # [N] int32 the target's argmax (draft index), see below
    # fp8 states (the online memory cache's, eagle3/train/online.py): a float32 scale a row,
    # dequantised per batch on the device
    aux_scale: torch.Tensor | None = None  # [N]
    final_scale: torch.Tensor | None = None  # [N]

    def remember_argmax(self, head: TargetHead, step: int = 1 << 18) -> None:
        """The target's full-vocab argmax of every stored token, computed once here (one pass of
        the target head over the states) so that each batch runs only its draft rows."""
        if self.final_scale is None:
            self.arg = target_argmax(self.final, head)
            return
        self.arg = torch.cat(
            [
                target_argmax(_rows(self.final, self.final_scale, slice(a, a + step)), head)
                for a in range(0, self.final.shape[0], step)
            ]
        )

    @classmethod
    def load(cls, ds: HiddenStateDataset, device: torch.device) -> DeviceData:
        """Read each shard once (whole tensors) into flat tensors allocated once on ``device``
        (no concatenation: the device never holds the states twice), keeping the rows of the
        samples ``ds`` lists."""
        by_shard: dict[str, list[int]] = {}
        for i, (shard, _, _) in enumerate(ds.entries):
            by_shard.setdefault(shard, []).append(i)
        shards = sorted(by_shard)
        rows = []
        for shard in shards:
            with safe_open(str(ds.root / shard), framework="pt") as h:
                rows.append(h.get_slice("input_ids").get_shape()[0])
        flat: dict[str, torch.Tensor] = {}
        start, length = [0] * len(ds), [0] * len(ds)
        at = 0
        for shard, n_rows in zip(shards, rows):
            with safe_open(str(ds.root / shard), framework="pt") as h:
                offsets = h.get_tensor("offsets").tolist()
                tensors = {
                    "ids": h.get_tensor("input_ids").long(),
                    "mask": h.get_tensor("loss_mask").bool(),
                    "aux": _states(h, "aux"),
                    "final": _states(h, "final"),
                }
            for k, v in tensors.items():
                if k not in flat:
                    flat[k] = torch.empty(sum(rows), *v.shape[1:], dtype=v.dtype, device=device)
                flat[k][at : at + n_rows].copy_(v)
            for i in by_shard[shard]:
                _, pos, n = ds.entries[i]
                start[i] = at + offsets[pos]
                length[i] = int(n)
            at += n_rows
        return cls(flat["ids"], flat["mask"], flat["aux"], flat["final"], start, length)


def _rows(x: torch.Tensor, scale: torch.Tensor | None, rows: torch.Tensor | slice) -> torch.Tensor:
    """``x[rows]``; fp8 (a ``scale``) dequantised to what the padded path gives: bf16 on CUDA,
    float32 on the CPU (eagle3/train/state_cache.py, ``MemoryCache.gather``)."""
    if scale is None:
        return x[rows]
    return dequantize_fp8(x[rows], scale[rows], torch.bfloat16 if x.is_cuda else torch.float32)


def make_batch_device(
    data: DeviceData,
    idx: list[int],
    head: TargetHead,
    max_seq_len: int,
    chunk: int = 1024,
    positions: str = "predicted",
) -> Batch:
    """:func:`eagle3.train.batch.make_batch_fast`'s batch (same padding, same values) gathered
    from :class:`DeviceData`: one index [B, L] built on the host, one gather per tensor."""
    dev = data.input_ids.device
    lens = [min(data.length[i], max_seq_len) for i in idx]
    L = max(lens)
    pos = torch.arange(L)
    valid = pos[None, :] < torch.tensor(lens)[:, None]
    rows = torch.tensor([data.start[i] for i in idx])[:, None] + pos[None, :]
    rows = torch.where(valid, rows, 0)
    pin = dev.type == "cuda"
    if pin:
        rows, valid = rows.pin_memory(), valid.pin_memory()
    rows, valid = rows.to(dev, non_blocking=pin), valid.to(dev, non_blocking=pin)
    ids = torch.where(valid, data.input_ids[rows], 0)
    mask = data.loss_mask[rows] & valid
    aux = _rows(data.aux, data.aux_scale, rows) * valid[..., None]
    final = _rows(data.final, data.final_scale, rows) * valid[..., None]
    arg = None if data.arg is None else data.arg[rows]
    return batch_from_padded(ids, mask, aux, final, valid, head, chunk, positions, arg)


__all__ = ["AUTO_SHARE", "DeviceData", "fits", "make_batch_device", "stored_bytes"]
