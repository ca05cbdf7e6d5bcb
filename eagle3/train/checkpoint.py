"""Checkpoints with exact resume (``out_dir/checkpoints/latest``), no pickle anywhere.

``model.safetensors`` (trainable weights), ``optimizer.safetensors`` (AdamW moments and step
counts, flattened as ``state.<param index>.<key>``), ``rng.safetensors`` (torch CPU/CUDA generator
states) and ``state.json`` (:class:`TrainState`, param groups, python RNG state, config). The LR
schedule is a pure function of the step, so the step counter is the scheduler state. Batch order
is a function of (seed, epoch), so resume skips the batches of the current epoch already done.
Distributed: the files are the single-process ones (FSDP's shards are gathered; on resume every
rank reads the whole files and keeps its shard).
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from eagle3.draft import DraftModel
from eagle3.train.distributed import gather_full, shard_like


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


def _optimizer_to_flat(
    opt: torch.optim.Optimizer, keep: bool = True
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``state.<param index>.<key>`` tensors (whole, gathered from FSDP shards) + param groups."""
    sd = opt.state_dict()
    tensors = {}
    for idx, st in sd["state"].items():
        for k, v in st.items():
            full = gather_full(v if torch.is_tensor(v) else torch.tensor(v), keep)
            if keep:
                tensors[f"state.{idx}.{k}"] = full
    return tensors, {"param_groups": sd["param_groups"]}


def _optimizer_from_flat(
    opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict[str, Any]
) -> None:
    params = [p for g in opt.param_groups for p in g["params"]]  # the indices of opt.state_dict()
    state: dict[int, dict[str, torch.Tensor]] = {}
    for name, v in tensors.items():
        _, idx, k = name.split(".", 2)
        ref = params[int(idx)]
        state.setdefault(int(idx), {})[k] = shard_like(v, ref) if v.shape == ref.shape else v
    # the optimizer's own implementation flags (fused or not: train.step_impl) win over the
    # checkpoint's, so a checkpoint resumes under either step (the state names are the same)
    impl = ("fused", "foreach", "capturable")
    groups = [
        {**g, **{k: cur[k] for k in impl if k in cur}}
        for g, cur in zip(meta["param_groups"], opt.param_groups)
    ]
    opt.load_state_dict({"state": state, "param_groups": groups})


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


def trainable_full(model: DraftModel, keep: bool) -> dict[str, torch.Tensor]:
    """The trainable weights, whole, on CPU where ``keep`` (FSDP shards gathered)."""
    out = {}
    for k, v in model.trainable_state_dict().items():
        full = gather_full(v, keep)
        if keep:
            out[k] = full
    return out


def save_checkpoint(
    ckpt_dir: Path,
    model: DraftModel,
    opt: torch.optim.Optimizer,
    state: TrainState,
    extra: dict[str, Any],
    *,
    write: bool = True,
    sharded: bool = False,
) -> Path:
    """Atomically (tmp folder + rename) replace ``ckpt_dir`` with the current state.

    Distributed: called on every rank; only ``write`` (rank 0) writes. With ``sharded`` (FSDP)
    every rank takes part in gathering the whole weights and optimizer state first; the files are
    the single-process ones either way."""
    ckpt_dir = Path(ckpt_dir)
    if not (write or sharded):
        return ckpt_dir
    weights = trainable_full(model, write)
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
    (tmp / "state.json").write_text(
        json.dumps(
            {"state": asdict(state), "optimizer": opt_meta, "python_rng": py_rng, **extra}, indent=1
        )
    )
    old = ckpt_dir.with_name(ckpt_dir.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if ckpt_dir.exists():
        ckpt_dir.rename(old)
    tmp.rename(ckpt_dir)
    shutil.rmtree(old, ignore_errors=True)
    return ckpt_dir


def load_checkpoint(
    ckpt_dir: Path, model: DraftModel, opt: torch.optim.Optimizer
) -> tuple[TrainState, dict]:
    """Every rank reads the whole files; FSDP ranks keep their shards (:func:`shard_like`)."""
    ckpt_dir = Path(ckpt_dir)
    meta = json.loads((ckpt_dir / "state.json").read_text())
    device = next(model.parameters()).device
    weights = load_file(str(ckpt_dir / "model.safetensors"), device=str(device))
    params = dict(model.named_parameters())
    weights = {k: shard_like(v, params[k]) if k in params else v for k, v in weights.items()}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    missing = [m for m in missing if not m.startswith("embed_tokens.")]
    if missing or unexpected:
        raise ValueError(
            f"{ckpt_dir}: checkpoint does not fit the draft: missing {missing}, "
            f"unexpected {unexpected}"
        )
    _optimizer_from_flat(
        opt,
        load_file(str(ckpt_dir / "optimizer.safetensors"), device=str(device)),
        meta["optimizer"],
    )
    _set_rng_state(load_file(str(ckpt_dir / "rng.safetensors")), meta["python_rng"])
    return TrainState(**meta["state"]), meta
