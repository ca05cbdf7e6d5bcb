"""Hidden-state storage: sharded safetensors, many samples per shard, bf16 or fp8.

Per shard (``hidden-NNNNN.safetensors``), samples are concatenated along the token axis:
  input_ids [N] int64, loss_mask [N] uint8,
  offsets [S+1] int64 (sample i = rows offsets[i]:offsets[i+1])
  aux   [N, 3H]  the auxiliary layers' states, concatenated in layer-id order
  final [N, H]   the last layer's output before the final norm (the target distribution comes
                 from it)
bf16: aux/final stored as bfloat16. fp8: float8_e4m3fn with one float32 scale per token row
(``aux_scale`` [N], ``final_scale`` [N]): amax/448 per row keeps every row's largest value exact-ish
and halves the disk (the field's main pain: ~8H bytes per token in bf16).
The shard's metadata holds the sample ids (JSON). ``index.json`` maps sample id ->
(shard, position).

Shards are written under a temporary name and renamed into place; the index is rewritten
atomically after each shard, so a killed run resumes from the last complete shard.
"""

from __future__ import annotations

import json
import os
import random
import struct
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from eagle3.atomic import atomic_path, write_json_atomic
from eagle3.batching import token_budget_batches
from eagle3.errors import CorruptArtifact

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (last dim) scaled e4m3: returns (fp8 tensor, float32 scale per row)."""
    x = x.float()
    scale = (x.abs().amax(dim=-1) / FP8_MAX).clamp(min=1e-12)
    return (x / scale.unsqueeze(-1)).to(torch.float8_e4m3fn), scale


def dequantize_fp8(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    return (q.float() * scale.unsqueeze(-1)).to(dtype)


def encode_states(name: str, x: torch.Tensor, storage_dtype: str) -> dict[str, torch.Tensor]:
    """One state tensor as stored: bf16, or fp8 with a float32 scale per row (``name_scale``).
    The shards and the online state cache (eagle3/train/online.py) store the same bytes."""
    if storage_dtype == "float8_e4m3fn":
        q, scale = quantize_fp8(x)
        return {name: q, f"{name}_scale": scale}
    return {name: x.to(torch.bfloat16)}


def decode_states(get: Any, name: str, fp8: bool, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of :func:`encode_states`; ``get(key)`` reads one stored tensor."""
    return dequantize_fp8(get(name), get(f"{name}_scale"), dtype) if fp8 else get(name).to(dtype)


@dataclass
class Sample:
    id: str
    input_ids: torch.Tensor  # [T] int64
    loss_mask: torch.Tensor  # [T] bool / uint8
    aux: torch.Tensor | None  # [T, 3H]; None in a token-only folder (extract.states: online)
    final: torch.Tensor | None  # [T, H]

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


def check_shard(path: Path) -> None:
    """Raise CorruptArtifact, naming the file, unless ``path`` is a whole safetensors file: its
    header parses and its size is what the header promises. Reads the header only (a shard is
    GBs)."""
    path = Path(path)
    fix = (
        f"delete its extract folder {path.parent} and rerun extract "
        "(or rerun with a new runs dir); "
        "the generate output is untouched"
    )
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size:
                raise ValueError(f"header length {n} > file size {size}")
            header = json.loads(f.read(n))
        end = max(
            (v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0
        )
    except FileNotFoundError:
        raise CorruptArtifact(
            f"{path}: shard listed in {path.parent / 'index.json'} is missing; {fix}"
        ) from None
    except (OSError, ValueError, struct.error, KeyError, TypeError) as e:
        raise CorruptArtifact(f"{path}: not a readable safetensors shard ({e}); {fix}") from None
    if size != 8 + n + end:
        raise CorruptArtifact(
            f"{path}: truncated safetensors shard ({size} bytes, its header promises "
            f"{8 + n + end}); {fix}"
        )


class ShardWriter:
    """Buffers samples and writes a shard every ``samples_per_shard``."""

    def __init__(self, root: Path, storage_dtype: str = "bfloat16", samples_per_shard: int = 256):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.dtype = storage_dtype
        self.per_shard = samples_per_shard
        self.index_path = self.root / "index.json"
        self.index: dict[str, list] = (
            json.loads(self.index_path.read_text()) if self.index_path.exists() else {}
        )
        self.shards = sorted({v[0] for v in self.index.values()})
        for shard in self.shards:  # a resume must not build on a shard that was cut short
            check_shard(self.root / shard)
        for stray in self.root.glob(".hidden-*.tmp"):
            stray.unlink()  # a shard that was being written when a run died
        self._buf: list[Sample] = []
        self._queued: set[str] = set()  # ids handed to the writer thread, not yet in the index
        # One writer thread: packing and writing a shard (GBs for a large target) overlaps the
        # next forward passes instead of stalling the GPU. Up to two shards queued (bounded memory);
        # one thread keeps shards and index updates in order.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-writer")
        self._inflight: deque[Future] = deque()
        self.tokens_written = 0
        self.bytes_written = 0

    @property
    def done_ids(self) -> set[str]:
        return set(self.index)

    def add(self, s: Sample) -> None:
        if s.id in self.index or s.id in self._queued:
            return
        self._buf.append(s)
        self._queued.add(s.id)
        if len(self._buf) >= self.per_shard:
            self.flush(wait=False)

    def _blocks(
        self, name: str, xs: list[torch.Tensor], pieces: dict[str, list[torch.Tensor]]
    ) -> None:
        """Per-sample row blocks of one stored tensor (fp8: quantised per row, with scales)."""
        for x in xs:
            for k, v in encode_states(name, x, self.dtype).items():
                pieces.setdefault(k, []).append(v)

    def flush(self, wait: bool = True) -> None:
        """Write the buffered samples as one shard (in the writer thread); ``wait`` for it to
        land."""
        if self._buf:
            self._wait(keep=1)
            name = f"hidden-{len(self.shards):05d}.safetensors"
            self.shards.append(name)
            buf, self._buf = self._buf, []
            self._inflight.append(self._pool.submit(self._write, name, buf))
        if wait:
            self._wait(keep=0)

    def _wait(self, keep: int) -> None:
        """Wait until at most ``keep`` writes are pending; re-raise a failed write (e.g. disk
        full)."""
        while len(self._inflight) > keep:
            self._inflight.popleft().result()

    def close(self) -> None:
        self.flush(wait=True)
        self._pool.shutdown()

    def _write(self, name: str, buf: list[Sample]) -> None:
        lengths = [len(s) for s in buf]
        offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
        offsets[1:] = torch.cumsum(torch.tensor(lengths), 0)
        pieces: dict[str, list[torch.Tensor]] = {
            "input_ids": [s.input_ids.long() for s in buf],
            "loss_mask": [s.loss_mask.to(torch.uint8) for s in buf],
            "offsets": [offsets],
        }
        states = buf[0].aux is not None  # a token-only folder (online states) has none
        if states:
            self._blocks("aux", [s.aux for s in buf], pieces)
            self._blocks("final", [s.final for s in buf], pieces)
        meta = {
            "ids": json.dumps([s.id for s in buf]),
            "storage_dtype": self.dtype if states else "none",
        }
        with atomic_path(self.root / name) as tmp:
            write_safetensors_blocks(tmp, pieces, meta)
        for i, s in enumerate(buf):
            self.index[s.id] = [name, i, len(s)]
            self._queued.discard(s.id)
        write_json_atomic(self.index_path, self.index)
        self.tokens_written += int(offsets[-1])
        self.bytes_written += (self.root / name).stat().st_size


_ST_DTYPE = {
    torch.bfloat16: "BF16",
    torch.float32: "F32",
    torch.int64: "I64",
    torch.uint8: "U8",
    torch.float8_e4m3fn: "F8_E4M3",
}


def write_safetensors_blocks(
    path: Path, pieces: dict[str, list[torch.Tensor]], metadata: dict[str, str]
) -> None:
    """Write a safetensors file whose tensors are given as lists of row blocks (joined along dim 0
    on disk), without joining them in memory.

    ``safetensors.torch.save_file`` needs each tensor whole and copies it again into bytes: for a
    shard of a large target that is GBs of copies, under the GIL, on the host that also drives the
    GPU. Here each block is written straight from its memory (the write releases the GIL).
    """
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for key, blocks in pieces.items():
        rows = sum(b.shape[0] for b in blocks)
        nbytes = sum(b.numel() * b.element_size() for b in blocks)
        header[key] = {
            "dtype": _ST_DTYPE[blocks[0].dtype],
            "shape": [rows, *blocks[0].shape[1:]],
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the format pads the header to 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for blocks in pieces.values():
            for b in blocks:
                f.write(memoryview(b.contiguous().view(torch.uint8).numpy()))
        f.flush()
        os.fsync(f.fileno())


class HiddenStateDataset:
    """Random access to stored samples (memory-mapped shards), for training.

    ``ds[i]`` -> Sample with aux/final in ``dtype`` (fp8 shards are dequantised on read).
    """

    def __init__(self, root: Path, dtype: torch.dtype = torch.bfloat16):
        self.root = Path(root)
        self.dtype = dtype
        index_path = self.root / "index.json"
        if not index_path.is_file():
            raise FileNotFoundError(
                f"{index_path}: no extract output here (run `eagle3 extract` first)"
            )
        index = json.loads(index_path.read_text())
        for shard in sorted({v[0] for v in index.values()}):
            check_shard(self.root / shard)
        self.ids = sorted(index)
        self.entries = [index[i] for i in self.ids]
        self._handles: dict[str, Any] = {}
        first = self._handle(self.entries[0][0]) if self.entries else None
        #: False for a token-only folder (extract.states: online): ids and masks, no states
        self.has_states = first is not None and "aux" in first.keys()
        #: the width of the stored aux states (len(aux_layers) x target hidden), if any
        self.aux_width = first.get_slice("aux").get_shape()[-1] if self.has_states else None

    def __len__(self) -> int:
        return len(self.ids)

    def length(self, i: int) -> int:
        return int(self.entries[i][2])

    def _handle(self, shard: str):
        if shard not in self._handles:
            self._handles[shard] = safe_open(str(self.root / shard), framework="pt")
        return self._handles[shard]

    def __getitem__(self, i: int) -> Sample:
        shard, pos, _ = self.entries[i]
        h = self._handle(shard)
        offsets = h.get_slice("offsets")[pos : pos + 2]
        a, b = int(offsets[0]), int(offsets[1])
        fp8 = h.metadata().get("storage_dtype") == "float8_e4m3fn"

        def states(name: str) -> torch.Tensor | None:
            if not self.has_states:
                return None
            return decode_states(lambda k: h.get_slice(k)[a:b], name, fp8, self.dtype)

        return Sample(
            self.ids[i],
            h.get_slice("input_ids")[a:b],
            h.get_slice("loss_mask")[a:b].bool(),
            states("aux"),
            states("final"),
        )

    def fetch(self, idx: list[int]) -> list[Sample]:
        """The samples ``idx`` (a batch): the interface the online states share."""
        return [self[i] for i in idx]

    def batches(
        self, token_budget: int, shuffle: bool = True, seed: int = 0
    ) -> Iterator[list[int]]:
        """Length-bucketed batches of indices: sorted by length, cut so that
        batch_size * longest <= token_budget (padding waste stays small), batches shuffled."""
        batches = token_budget_batches([self.length(i) for i in range(len(self))], token_budget)
        if shuffle:
            random.Random(seed).shuffle(batches)
        yield from batches


def iter_token_masks(root: Path) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(input_ids, loss_mask) of every stored sample, without touching the hidden states."""
    for shard in sorted(Path(root).glob("hidden-*.safetensors")):
        check_shard(shard)
        with safe_open(str(shard), framework="pt") as h:
            ids, mask, offsets = (
                h.get_tensor("input_ids"),
                h.get_tensor("loss_mask"),
                h.get_tensor("offsets"),
            )
        for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
            yield ids[a:b], mask[a:b]


def tokens_key(extract_dir: Path, generate_data_key: str) -> str:
    """What the vocab stage reads from an extract folder: the token ids and loss masks of the
    stored samples. They are the generated samples (``generate_data_key``) cut to their stored
    lengths, so hashing the (id, length) pairs identifies them without reading the hidden states:
    a new extraction at other auxiliary layers or in another dtype leaves the vocabulary cached."""
    from eagle3.artifacts import digest

    index = json.loads((Path(extract_dir) / "index.json").read_text())  # id -> [shard, pos, length]
    samples = sorted((i, int(v[2])) for i, v in index.items())
    return digest({"data": generate_data_key, "samples": samples})
