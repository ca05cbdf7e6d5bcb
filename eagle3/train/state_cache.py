"""Where online training keeps the target's states between epochs: a flat cache in memory (the
training GPU, or host memory) and, after it, one file a sample on disk; :func:`cache_plan` splits
``train.state_cache_gib`` between them (eagle3/train/online.py says why)."""

from __future__ import annotations

import hashlib
import json
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eagle3.atomic import atomic_path, write_json_atomic
from eagle3.extract.storage import decode_states, dequantize_fp8, encode_states
from eagle3.plan_rates import DISK_MARGIN_MIN, DISK_MARGIN_SHARE, HOST_SHARE
from eagle3.train.device_data import AUTO_SHARE, DeviceData


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


def state_bytes(n_tokens: int, aux_width: int, hidden: int, storage_dtype: str) -> int:
    """Bytes of ``n_tokens`` tokens' stored states (fp8: + a float32 scale a row, aux and final)."""
    width = aux_width + hidden
    if storage_dtype == "float8_e4m3fn":
        return n_tokens * (width + 8)
    return n_tokens * width * 2


class MemoryCache:
    """Stored-form states of up to ``capacity`` tokens in flat tensors on one device (the
    training GPU, or host memory: pinned when a GPU trains); sample i at rows
    ``start[i] : start[i] + n``. Filled in the order samples are produced, nothing evicted (with
    a new order every epoch any policy hits capacity / total of the time; this one copies each
    sample once). Used from one thread (the loader's)."""

    def __init__(
        self,
        capacity: int,
        aux_width: int,
        hidden: int,
        storage_dtype: str,
        device: torch.device,
        pin: bool = False,
    ):
        self.fp8 = storage_dtype == "float8_e4m3fn"
        dt = torch.float8_e4m3fn if self.fp8 else torch.bfloat16
        self.capacity, self.device, self.used = int(capacity), device, 0
        pin = pin and device.type == "cpu"

        def buf(width: int, dtype: torch.dtype) -> torch.Tensor:
            shape = (self.capacity, width) if width else (self.capacity,)
            return torch.empty(shape, dtype=dtype, device=device, pin_memory=pin)

        self.aux, self.final = buf(aux_width, dt), buf(hidden, dt)
        self.aux_scale = buf(0, torch.float32) if self.fp8 else None
        self.final_scale = buf(0, torch.float32) if self.fp8 else None
        self.start: dict[int, tuple[int, int]] = {}  # sample index -> (first row, rows)
        self.bytes_per_token = state_bytes(1, aux_width, hidden, storage_dtype)

    @property
    def bytes(self) -> int:
        return self.used * self.bytes_per_token

    def put(self, i: int, stored: dict[str, torch.Tensor]) -> bool:
        """Copy sample ``i``'s stored states in if there is room; True if kept."""
        n = stored["aux"].shape[0]
        if i in self.start or self.used + n > self.capacity:
            return False
        at = self.used
        for name in ("aux", "final", "aux_scale", "final_scale"):
            buf = getattr(self, name)
            if buf is not None:  # async only device to device: the host reads host copies
                src = stored[name]
                buf[at : at + n].copy_(src, non_blocking=src.device == buf.device)
        self.start[i] = (at, n)
        self.used += n
        return True

    def get(self, i: int) -> dict[str, torch.Tensor]:
        """Sample ``i``'s stored states: views of the flat tensors."""
        a, n = self.start[i]
        names = ("aux", "final", "aux_scale", "final_scale") if self.fp8 else ("aux", "final")
        return {k: getattr(self, k)[a : a + n] for k in names}

    def gather(
        self, idx: list[int], lens: list[int], dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Padded [B, L, .] aux and final of samples ``idx`` cut to ``lens`` (all held here), in
        ``dtype``, zero beyond each length: one gather per tensor, as offline's device data."""
        L = max(lens)
        pos = torch.arange(L)
        valid = pos[None, :] < torch.tensor(lens)[:, None]
        rows = torch.tensor([self.start[i][0] for i in idx])[:, None] + pos[None, :]
        rows = torch.where(valid, rows, 0).to(self.device, non_blocking=True)
        valid = valid.to(self.device, non_blocking=True)[..., None]
        out = []
        for name in ("aux", "final"):
            x = getattr(self, name)[rows]
            if self.fp8:
                x = dequantize_fp8(x, getattr(self, f"{name}_scale")[rows], dtype)
            out.append(torch.where(valid, x.to(dtype), 0))
        return out[0], out[1]

    def as_device_data(self, tokens: Any, device: torch.device) -> DeviceData:
        """Every held sample as :class:`~eagle3.train.device_data.DeviceData`: views of the flat
        state tensors (fp8 stays fp8 with its scales), the token ids and loss masks of
        ``tokens`` (the extract's) copied to ``device`` in this cache's row order."""
        ids = torch.zeros(self.used, dtype=torch.int64)
        mask = torch.zeros(self.used, dtype=torch.bool)
        start, length = [0] * len(tokens), [0] * len(tokens)
        for i, (at, n) in self.start.items():
            s = tokens[i]
            ids[at : at + n], mask[at : at + n] = s.input_ids[:n], s.loss_mask[:n]
            start[i], length[i] = at, n
        rows = slice(0, self.used)
        return DeviceData(
            ids.to(device),
            mask.to(device),
            self.aux[rows],
            self.final[rows],
            start,
            length,
            aux_scale=None if self.aux_scale is None else self.aux_scale[rows],
            final_scale=None if self.final_scale is None else self.final_scale[rows],
        )


class StateCache:
    """At most ``budget_bytes`` of samples' stored states on disk, one safetensors file each:
    the tier after :class:`MemoryCache`, for states memory cannot hold (a large target's).

    The first samples that fit stay. Files are written under a temporary name and renamed, so
    a killed run leaves whole files only (a resumed run reads them again); ``settings`` (the
    extract settings the states depend on) is checked at open, and a cache made with others is
    emptied.

    Shared by the training ranks of one node (``world`` > 1): each writes at most its budget,
    any reads every rank's files (a sample rank 1 cached is a hit for rank 0 in a later epoch:
    the ranks get other batches every epoch). Only the ``owner`` (rank 0) tidies at open; the
    others open after it (a barrier in between, eagle3/train/online.py)."""

    def __init__(
        self,
        root: Path,
        budget_bytes: int,
        settings: dict[str, Any],
        owner: bool = True,
        world: int = 1,
    ):
        self.root, self.budget, self.shared = Path(root), int(budget_bytes), world > 1
        self.root.mkdir(parents=True, exist_ok=True)
        marker = self.root / "cache.json"
        if owner:
            same = marker.is_file() and json.loads(marker.read_text()) == settings
            for f in self.root.iterdir():
                if f.name.endswith(".tmp") or (not same and f.suffix == ".safetensors"):
                    f.unlink()
            write_json_atomic(marker, settings)
        self.sizes = {f.stem: f.stat().st_size for f in self.root.glob("*.safetensors")}
        self.bytes = sum(self.sizes.values()) // world  # a resumed run's files: a share each
        self.peak = self.bytes
        self._lock = threading.Lock()

    @staticmethod
    def _name(sample_id: str) -> str:
        return hashlib.sha1(sample_id.encode()).hexdigest()

    def _path(self, name: str) -> Path:
        return self.root / f"{name}.safetensors"

    def has(self, sample_id: str) -> bool:
        name = self._name(sample_id)
        return name in self.sizes or (self.shared and self._path(name).is_file())

    def get(self, sample_id: str) -> dict[str, torch.Tensor] | None:
        name = self._name(sample_id)
        if name not in self.sizes and not (self.shared and self._path(name).is_file()):
            return None
        with safe_open(str(self._path(name)), framework="pt") as h:
            return {k: h.get_tensor(k) for k in h.keys()}

    def put(self, sample_id: str, tensors: dict[str, torch.Tensor]) -> bool:
        """Keep the sample if it fits the budget (header included); True if kept."""
        name = self._name(sample_id)
        need = sum(t.numel() * t.element_size() for t in tensors.values()) + 1024
        with self._lock:
            taken = name in self.sizes or (self.shared and self._path(name).is_file())
            if taken or self.bytes + need > self.budget:
                return False
            self.sizes[name] = need  # reserved: another thread may not take the same room
            self.bytes += need
        path = self._path(name)
        with atomic_path(path) as tmp:
            save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, str(tmp))
        size = path.stat().st_size
        with self._lock:
            self.bytes += size - self.sizes[name]
            self.sizes[name] = size
            self.peak = max(self.peak, self.bytes)
        return True


def disk_bytes(folder: Path) -> int:
    """Bytes of every file under ``folder`` (what the run holds there now)."""
    return sum(f.stat().st_size for f in Path(folder).rglob("*") if f.is_file())


def _size(n: float) -> str:
    return f"{n / 1024**3:.2f} GiB" if n >= 1024**3 / 100 else f"{n / 1024**2:.1f} MiB"


def _host_available() -> int:
    """Available host memory (Linux MemAvailable), or 0 where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


@dataclass
class CachePlan:
    """Where a run keeps its states (``train.state_cache_gib`` resolved on this machine)."""

    total: int  # bytes of every sample's stored states
    memory: int  # bytes kept in memory ...
    memory_device: torch.device  # ... on this device (the training GPU, or the CPU)
    disk: int  # bytes kept on disk after memory is full
    why: str  # one line: how the figures were reached

    def as_dict(self) -> dict[str, Any]:
        return {
            "total_bytes": self.total,
            "memory_bytes": self.memory,
            "memory_device": str(self.memory_device),
            "disk_bytes": self.disk,
            "why": self.why,
        }


def cache_plan(
    setting: float | str,
    memory_setting: float | str,
    total: int,
    device: torch.device,
    disk_root: Path,
    world: int = 1,
) -> CachePlan:
    """Split the budget between memory and disk.

    The budget is ``setting`` GiB (``auto``: every state), a rank's ``1/world`` of it. Memory
    first: the training GPU when the budget takes at most ``AUTO_SHARE`` of its free memory
    (the rule that puts offline states there), else host memory, at most ``HOST_SHARE`` of what
    is available, shared by the node's ranks (``memory_setting`` GiB instead of either when
    set). Disk takes the rest (``world`` ranks write into one folder, each its share), never
    more than the free space less a margin (``DISK_MARGIN_SHARE`` of it, at least
    ``DISK_MARGIN_MIN``). ``eagle3 plan`` prices the layouts by the same rule
    (eagle3/plan_rates.py holds the constants)."""
    budget = (total if setting == "auto" else min(total, int(float(setting) * 1024**3))) // world
    why = [f"budget {_size(budget)} of {_size(total)}"]
    if memory_setting != "auto":
        mem_cap = int(float(memory_setting) * 1024**3) // world
        where = device if device.type == "cuda" else torch.device("cpu")
        why.append(f"memory set to {_size(mem_cap)}")
    elif device.type == "cuda" and budget <= AUTO_SHARE * torch.cuda.mem_get_info(device)[0]:
        mem_cap, where = budget, device
        why.append(f"fits {AUTO_SHARE:.0%} of the GPU's free memory")
    else:
        mem_cap, where = int(HOST_SHARE * _host_available()) // world, torch.device("cpu")
        why.append(f"host memory: {HOST_SHARE:.0%} of available = {_size(mem_cap)}")
    memory = min(budget, mem_cap)
    rest = budget - memory
    disk = 0
    if rest > 0:
        probe = Path(disk_root)
        while not probe.exists():
            probe = probe.parent
        usage = shutil.disk_usage(probe)
        room = max(0, int(usage.free - max(DISK_MARGIN_SHARE * usage.free, DISK_MARGIN_MIN)))
        disk = min(rest, room)
        why.append(f"disk: {_size(disk)} (free less margin: {_size(room)})")
    return CachePlan(total, memory, where, disk, "; ".join(why))


__all__ = [
    "CachePlan",
    "MemoryCache",
    "StateCache",
    "cache_plan",
    "disk_bytes",
    "from_stored",
    "state_bytes",
    "stored_form",
]
