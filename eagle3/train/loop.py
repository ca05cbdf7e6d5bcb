"""The train stage: build the draft, run the epochs of TTT steps, export the draft (nanoGPT style).

One process, or N under torchrun (DDP or FSDP, :mod:`eagle3.train.distributed`); nothing global
(all state lives in :class:`~eagle3.train.checkpoint.TrainState`, the model and the optimizer).
:func:`train` reads top to bottom: open the extract, build the draft, set up the run, resume,
run the epochs, refuse a draft that never took a finite step, export, write the manifest.
"""

from __future__ import annotations

import copy
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from eagle3.atomic import write_json_atomic
from eagle3.draft import DraftModel
from eagle3.extract.storage import HiddenStateDataset
from eagle3.serving.gpus import release_gpus
from eagle3.target_checkpoint import checkpoint_dir
from eagle3.tracking import Tracker, open_train_tracker
from eagle3.train.batch import add_feature_noise, epoch_batches, make_batch, zero_weight
from eagle3.train.build import build_model
from eagle3.train.checkpoint import TrainState, load_checkpoint, save_checkpoint, trainable_full
from eagle3.train.compiled import maybe_compile
from eagle3.train.device_data import DeviceData, fits, make_batch_device
from eagle3.train.distributed import Dist, hold_frozen_bf16, init_distributed, wrap_for_training
from eagle3.train.loader import Loader, open_extract, prefetch_on
from eagle3.train.metrics import epoch_metrics, write_metrics
from eagle3.train.online import OnlineStates, open_online, states_report
from eagle3.train.optim import lr_at, make_optimizer
from eagle3.train.progress import StepQueue, check_finite
from eagle3.train.resume_guard import extract_identity, resumable
from eagle3.train.step import make_autocast, resolve_step_impl, train_step_async
from eagle3.train.step_fast import PendingStep, StepResult
from eagle3.train.target import TargetHead, load_target_head
from eagle3.train.ttt import column_names
from eagle3.train.weight_cast import set_weight_cast
from eagle3.vocab import VocabMapping, load_vocab


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
        return _train(
            cfg,
            Path(extract_dir),
            Path(vocab_path),
            Path(target_dir),
            Path(out_dir),
            on_progress,
            max_steps,
            resume,
            d,
            dev,
        )
    finally:
        if d.owns_group:
            dist.destroy_process_group()


@dataclass
class Run:
    """What one training run holds once set up: the data, the draft, its wrapper and optimizer,
    the schedule and where checkpoints go."""

    cfg: Any
    d: Dist
    dev: torch.device
    ds: HiddenStateDataset | OnlineStates
    head: TargetHead
    model: DraftModel
    net: nn.Module  # the TTT objective, under DDP / FSDP when distributed
    opt: torch.optim.Optimizer
    trainable: list[torch.Tensor]
    export_copy: DraftModel | None  # FSDP: rank 0's unsharded copy to export from
    group: int  # batches per optimizer step (the global batch)
    total_steps: int
    ckpt: Path
    extra: dict[str, Any]  # what state.json carries besides the state
    impl: str = "eager"  # the TTT step (train.step_impl resolved)
    data: DeviceData | None = None  # every sample on the device (train.data_on_device)
    loader: Loader | None = None  # the fast step's batches from the shards (prefetched)
    tracker: Tracker = field(default_factory=Tracker)  # TensorBoard (eagle3/tracking.py)

    def save(self, state: TrainState) -> None:
        save_checkpoint(
            self.ckpt,
            self.model,
            self.opt,
            state,
            self.extra,
            write=self.d.main,
            sharded=self.d.mode == "fsdp",
        )


def _train(
    cfg: Any,
    extract_dir: Path,
    vocab_path: Path,
    target_dir: Path,
    out_dir: Path,
    on_progress: Callable[[dict[str, Any]], None] | None,
    max_steps: int | None,
    resume: bool,
    d: Dist,
    dev: torch.device,
) -> dict[str, Any]:
    if d.main:
        out_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    vocab = load_vocab(Path(vocab_path))
    # on a GPU the states are read in their storage dtype (bf16): the step casts them there
    ds = open_extract(extract_dir, list(cfg.aux_layers), dev.type == "cuda")
    model = build_model(cfg, target_dir, vocab, ds)
    if not ds.has_states:  # extract.states online: the target produces them as train asks
        ds = open_online(cfg, ds, target_dir, out_dir, dev, ds.dtype, d.rank, d.world)
    run = None
    try:
        run = set_up(cfg, model, ds, vocab, target_dir, out_dir, d, dev)
        run.tracker = open_train_tracker(cfg, out_dir, d.main, model, ds, dev, d.world)
        state, resumed_from = TrainState(), None
        if resume and resumable(run.ckpt, run.extra["extract"], extract_dir):
            state = resume_from(run)
            resumed_from = state.step
        loop_started = time.time()
        finished = run_epochs(run, state, out_dir, max_steps, on_progress)
        if d.world > 1 and isinstance(ds, OnlineStates):
            dist.barrier()  # rank 0 stops the shared vLLM server: every rank is done asking
    finally:
        close_data(run, ds)
    if not finished:
        run.save(state)
        if d.world > 1:
            dist.barrier()
        done = {"step": state.step, "total_steps": run.total_steps, "checkpoint": str(run.ckpt)}
        return {"stage": "train", "complete": False, **done}

    loop_s = round(time.time() - loop_started, 2)  # the steps alone (no setup, no export)
    check_finite(state, extract_dir)
    export_dir = export(run, vocab, state, out_dir / "vllm-draft")
    tc = cfg.train
    manifest = {
        "stage": "train",
        "complete": True,
        "target_dir": str(target_dir),
        "extract_dir": str(extract_dir),
        "vocab": str(vocab_path),
        "export": str(export_dir),
        "draft_config": model.config.to_dict(),
        "train_config": tc.model_dump(mode="json"),
        "samples": len(ds),
        "steps": state.step,
        "updates": state.updates,
        "skipped_nan": state.skipped_nan,
        "total_steps": run.total_steps,
        "resumed_from_step": resumed_from,
        "final": state.history[-1] if state.history else None,
        "device": str(dev),
        "distributed": {
            "mode": d.mode,
            "world_size": d.world,
            "grad_accum": tc.grad_accum,
            "batches_per_step": run.group,
        },
        **{k: run.extra[k] for k in ("data_on_device", "compiled", "weight_cast")},
        "states": states_report(cfg.extract, run.loader, run.ds),
        "loop_s": loop_s,
        "wall_s": round(time.time() - started, 2),
    }
    if d.main:
        write_json_atomic(out_dir / "manifest.json", manifest)
        run.tracker.train_end(manifest)
    if d.world > 1:
        dist.barrier()  # the export and manifest exist when any rank returns
    return manifest


def close_data(run: Run | None, ds: HiddenStateDataset | OnlineStates) -> None:
    """Stop the loader thread and, online, the states' producer (a vLLM server it started
    stops here, on an error too)."""
    if run is not None and run.loader is not None:
        run.loader.close()
    if run is not None:
        run.tracker.flush()  # closed by train_end: the run's totals come after this
    if isinstance(ds, OnlineStates):
        ds.close()


def set_up(
    cfg: Any,
    model: DraftModel,
    ds: HiddenStateDataset | OnlineStates,
    vocab: VocabMapping,
    target_dir: Path,
    out_dir: Path,
    d: Dist,
    dev: torch.device,
) -> Run:
    """Move the draft to the device, wrap it (DDP / FSDP), build the optimizer and the schedule."""
    tc = cfg.train
    # FSDP shards the draft in place: rank 0 keeps an unsharded CPU copy (frozen tensors shared)
    # to load the gathered final weights into for the export.
    export_copy = (
        copy.deepcopy(model, {id(p): p for p in model.parameters() if not p.requires_grad})
        if d.mode == "fsdp" and d.main
        else None
    )
    model.to(dev)
    hold_frozen_bf16(model, dev)
    impl = resolve_step_impl(tc.step_impl)
    compiled = maybe_compile(model, tc.compile, dev, impl, d.mode)
    weight_cast = set_weight_cast(model, tc.weight_cast, dev, impl, d.mode)
    head = load_target_head(target_dir, vocab.draft_ids, model.config.rms_norm_eps).to(dev)
    net = wrap_for_training(model, d, dev, tc.ttt_steps, tc.ttt_decay, impl, tc.parallel_depths)
    # fused AdamW (and its found_inf NaN guard) on CUDA; not under FSDP, whose DTensor
    # parameters have not been run through it on a GPU here (the host-side guard is used there)
    fused = impl == "fast" and dev.type == "cuda" and d.mode != "fsdp"
    opt = make_optimizer(model, tc.lr, tc.weight_decay, fused, tc.optimizer, tc.muon_weight_decay)
    trainable = [p for p in model.parameters() if p.requires_grad]
    group = d.world * tc.grad_accum
    total_steps = sum(
        math.ceil(len(epoch_batches(ds, tc.token_budget, tc.seed, e, tc.batching)) / group)
        for e in range(tc.epochs)
    )
    on_device = isinstance(ds, HiddenStateDataset) and (
        tc.data_on_device == "on" or (tc.data_on_device == "auto" and fits(ds, dev))
    )
    t0 = time.time()
    data = DeviceData.load(ds, dev) if on_device else None
    if data is not None:
        data.remember_argmax(head)
    load_s = round(time.time() - t0, 2)
    loader = make_loader(tc, ds, head, dev) if data is None and impl == "fast" else None
    extra = {
        "total_steps": total_steps,
        "global_batches": group,
        "world_size": d.world,
        "data_on_device": {"on": data is not None, "load_s": load_s},
        "compiled": compiled,
        "weight_cast": weight_cast,
        "train_config": tc.model_dump(mode="json"),
        "draft_config": model.config.to_dict(),
        "extract": extract_identity(ds.root),  # a checkpoint resumes only on its own extract
    }
    return Run(
        cfg,
        d,
        dev,
        ds,
        head,
        model,
        net,
        opt,
        trainable,
        export_copy,
        group,
        total_steps,
        out_dir / "checkpoints" / "latest",
        extra,
        impl,
        data,
        loader,
    )


def make_loader(
    tc: Any, ds: HiddenStateDataset | OnlineStates, head: TargetHead, dev: torch.device
) -> Loader:
    """The fast step's batches: read from the shards and padded, or (online) made by the
    online states themselves (produced and gathered on the device)."""
    online = isinstance(ds, OnlineStates)
    return Loader(
        None,
        head,
        dev,
        tc.max_seq_len,
        tc.loss_positions,
        prefetch_on(tc.prefetch, dev),
        fetch=None if online else ds.fetch,
        make=ds.padded if online else None,
    )


def resume_from(run: Run) -> TrainState:
    """The state of ``run.ckpt`` (weights and optimizer loaded); refused from another schedule."""
    state, meta = load_checkpoint(run.ckpt, run.model, run.opt)
    if (
        meta.get("total_steps") != run.total_steps
        or meta.get("draft_config") != run.model.config.to_dict()
    ):
        raise ValueError(
            f"{run.ckpt}: checkpoint from a different run (schedule or draft shape differs; a run "
            f"of {meta.get('global_batches', 1)} batches per step resumes with world size x "
            f"train.grad_accum = {meta.get('global_batches', 1)}, this one has {run.group})"
        )
    return state


def run_epochs(
    run: Run,
    state: TrainState,
    out_dir: Path,
    max_steps: int | None,
    on_progress: Callable[[dict[str, Any]], None] | None,
) -> bool:
    """Optimizer steps until the last epoch ends (True) or ``max_steps`` is reached (False).
    Checkpoints every ``checkpoint_every_steps`` and after each epoch. One step is in flight
    (:class:`~eagle3.train.progress.StepQueue`): its metrics are read once the next is queued."""
    tc, d = run.cfg.train, run.d
    autocast = make_autocast(run.dev, run.extra["weight_cast"], tc.sdpa)
    run.model.train()
    queue = StepQueue(state, run.total_steps, run.tracker.wrap(on_progress) if d.main else None)
    while state.epoch < tc.epochs:
        epoch_t0 = time.perf_counter()
        batches = epoch_batches(run.ds, tc.token_budget, tc.seed, state.epoch, tc.batching)
        while state.batch_in_epoch < len(batches):
            if max_steps is not None and state.step >= max_steps:
                queue.settle()
                return False
            at, g = state.batch_in_epoch, run.group
            if isinstance(run.ds, OnlineStates) and run.data is None:  # ahead of the loader
                run.ds.request_ahead(batches, at, tc.online_prefetch * g, d.rank, d.world)
            if run.loader is not None and run.data is None:  # this step's batches and the next
                run.loader.prefetch(batches[at : at + 2 * g][d.rank :: d.world])
            lr = lr_at(state.step, run.total_steps, tc.lr, tc.warmup_ratio, tc.lr_schedule)
            step_batches = batches[at : at + g]
            toks = sum(min(run.ds.length(i), tc.max_seq_len) for b in step_batches for i in b)
            queue.push(optimizer_step(run, step_batches, lr, autocast), lr, len(step_batches), toks)
            if state.step % tc.checkpoint_every_steps == 0:
                queue.settle()
                run.save(state)
        queue.settle()
        state.history.append(epoch_metrics(state, column_names(tc.ttt_steps, tc.parallel_depths)))
        now = time.perf_counter()
        state.history[-1]["s"] = round(now - epoch_t0, 2)  # resumed: the rest
        state.history[-1]["time"] = queue.take_times(epoch_t0, now)
        if isinstance(run.ds, OnlineStates):  # where this epoch's states came from
            state.history[-1]["states"] = run.ds.take_epoch()
            run.data = run.data or run.ds.device_data(run.head)  # all cached: offline path
        state.epoch += 1
        state.batch_in_epoch = 0
        state.epoch_sums = {}
        if d.main:
            write_metrics(out_dir, state.history)
            run.tracker.train_epoch(state.history[-1])
        run.save(state)
    return True


def optimizer_step(
    run: Run, step_batches: list[list[int]], lr: float, autocast: Any
) -> StepResult | PendingStep:
    """One step on the global batch ``step_batches``: this rank's share of it, at rate ``lr``."""
    tc, d = run.cfg.train, run.d
    mine = step_batches[d.rank :: d.world]  # up to grad_accum batches of this rank
    micro = [batch_of(run, idx) for idx in mine]
    if tc.feature_noise > 0:
        for b in micro:
            add_feature_noise(b, tc.feature_noise)
    if not micro:  # the epoch's short last group: join the all-reduce with nothing counted
        micro = [zero_weight(batch_of(run, step_batches[0]))]
    for g in run.opt.param_groups:
        g["lr"] = lr
    return train_step_async(
        run.net,
        run.opt,
        run.trainable,
        micro,
        d,
        tc.grad_clip,
        autocast,
    )


def batch_of(run: Run, idx: list[int]) -> Any:
    """The padded batch of samples ``idx``: gathered on the device when the data lives there,
    else read from the shards (the fast step's loader, or the eager step's reference batch)."""
    tc = run.cfg.train
    if run.data is not None:
        if isinstance(run.ds, OnlineStates):
            run.ds.count_memory(idx)
        return make_batch_device(
            run.data, idx, run.head, tc.max_seq_len, positions=tc.loss_positions
        )
    if run.loader is not None:
        return run.loader.batch(idx)
    samples = run.ds.fetch(idx)
    return make_batch(samples, run.head, run.dev, tc.max_seq_len, positions=tc.loss_positions)


def export(run: Run, vocab: VocabMapping, state: TrainState, export_dir: Path) -> Path:
    """Rank 0 writes the vLLM-format export (FSDP: the weights gathered into its unsharded copy)."""
    from eagle3.draft.export import export_vllm

    model = run.model
    if (
        run.d.mode == "fsdp"
    ):  # gather the final weights (every rank), load them into rank 0's unsharded copy
        final_weights = trainable_full(model, run.d.main)
        if run.export_copy is not None:
            run.export_copy.load_state_dict(final_weights, strict=False)
            model = run.export_copy
    if run.d.main:
        model.eval()
        export_dir = export_vllm(
            model.to("cpu").float(),
            None,
            vocab.d2t,
            vocab.t2d,
            export_dir,
            metadata={"stage": "train", "steps": state.step, "epochs": run.cfg.train.epochs},
        )
    return export_dir
