"""Train stage: the EAGLE-3 draft on stored target hidden states (nanoGPT style, one file).

Single process for now; nothing global (all state lives in :class:`TrainState`, the model and the
optimizer), so DDP/FSDP can wrap :func:`ttt_loss` / the loop later.

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
"""

from __future__ import annotations

import json
import math
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from eagle3.extract.storage import HiddenStateDataset
from eagle3.model import DraftConfig, Eagle3Draft, build_draft, load_target_embeddings, load_target_tensor
from eagle3.generate.storage import write_json_atomic
from eagle3.vocab import load_vocab

NORM_NAMES = (
    "model.norm.weight",
    "language_model.model.norm.weight",
    "model.language_model.norm.weight",
    "norm.weight",
)
MAX_CONSECUTIVE_NAN = 5


class TrainingDiverged(RuntimeError):
    """Too many non-finite steps in a row."""


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


def ttt_loss(model: Eagle3Draft, batch: Batch, ttt_steps: int, ttt_decay: float) -> tuple[torch.Tensor, list[dict]]:
    """Unrolled loss (weighted sum over steps) and per-step {loss, correct, count}."""
    total = torch.zeros((), device=batch.input_ids.device)
    stats = []
    for i, out, logits in ttt_unroll(model, batch, ttt_steps):
        _, probs, arg, ok = step_inputs(batch, i)
        logp = torch.log_softmax(logits.float(), dim=-1)
        ce = -(probs * logp).sum(-1)  # [B, L]
        count = int(ok.sum())
        loss_i = (ce * ok.float()).sum() / max(count, 1)
        total = total + (ttt_decay**i) * loss_i
        with torch.no_grad():
            correct = int(((logits.argmax(-1) == arg) & ok).sum())
        stats.append({"loss": float(loss_i.detach()), "correct": correct, "count": count})
    return total, stats


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
    step: int = 0  # batches consumed overall (schedule position), skipped ones included
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


def _optimizer_to_flat(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    sd = opt.state_dict()
    tensors = {}
    for idx, st in sd["state"].items():
        for k, v in st.items():
            tensors[f"state.{idx}.{k}"] = (v if torch.is_tensor(v) else torch.tensor(v)).detach().cpu().contiguous()
    return tensors, {"param_groups": sd["param_groups"]}


def _optimizer_from_flat(opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    state: dict[int, dict[str, torch.Tensor]] = {}
    for name, v in tensors.items():
        _, idx, k = name.split(".", 2)
        state.setdefault(int(idx), {})[k] = v
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


def save_checkpoint(ckpt_dir: Path, model: Eagle3Draft, opt: torch.optim.Optimizer, state: TrainState,
                    extra: dict[str, Any]) -> Path:
    """Atomically (tmp folder + rename) replace ``ckpt_dir`` with the current state."""
    ckpt_dir = Path(ckpt_dir)
    tmp = ckpt_dir.with_name(ckpt_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in model.trainable_state_dict().items()},
              str(tmp / "model.safetensors"))
    opt_t, opt_meta = _optimizer_to_flat(opt)
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
    ckpt_dir = Path(ckpt_dir)
    meta = json.loads((ckpt_dir / "state.json").read_text())
    device = next(model.parameters()).device
    weights = load_file(str(ckpt_dir / "model.safetensors"), device=str(device))
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
    that many batches overall (checkpointing first; the schedule still spans all epochs): a later
    call with ``resume=True`` continues exactly. ``on_progress`` gets a dict per batch.
    """
    tc = cfg.train
    extract_dir, out_dir, target_dir = Path(extract_dir), Path(out_dir), Path(target_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    started = time.time()

    vocab = load_vocab(Path(vocab_path))
    ds = HiddenStateDataset(extract_dir, dtype=torch.float32)
    if len(ds) == 0:
        raise ValueError(f"{extract_dir}: no samples")
    aux_layers = list(cfg.aux_layers)
    man_path = extract_dir / "manifest.json"
    if man_path.is_file():
        stored = json.loads(man_path.read_text()).get("aux_layers")
        if stored is not None and list(stored) != aux_layers:
            raise ValueError(f"extract stored aux layers {stored}, config says {aux_layers}")

    overrides = {k: v for k, v in {"num_attention_heads": tc.draft_num_attention_heads,
                                   "num_key_value_heads": tc.draft_num_key_value_heads,
                                   "intermediate_size": tc.draft_intermediate_size}.items() if v is not None}
    torch.manual_seed(tc.seed)
    random.seed(tc.seed)
    model = build_draft(target_dir, vocab.draft_vocab_size, aux_layers, **overrides)
    dcfg: DraftConfig = model.config
    if vocab.target_vocab_size != dcfg.vocab_size:
        raise ValueError(f"vocab built for {vocab.target_vocab_size} target ids, target has {dcfg.vocab_size}")
    if ds[0].aux.shape[-1] != dcfg.fc_input_size:
        raise ValueError(f"stored aux width {ds[0].aux.shape[-1]} != {len(aux_layers)} x {dcfg.target_hidden_size}")
    model.to(dev)
    head = load_target_head(target_dir, vocab.draft_ids, dcfg.rms_norm_eps).to(dev)
    opt = make_optimizer(model, tc.lr, tc.weight_decay)
    trainable = [p for p in model.parameters() if p.requires_grad]

    per_epoch = len(_epoch_batches(ds, tc.token_budget, tc.seed, 0))
    total_steps = per_epoch * tc.epochs
    ckpt = out_dir / "checkpoints" / "latest"
    extra = {"total_steps": total_steps, "train_config": tc.model_dump(mode="json"), "draft_config": dcfg.to_dict()}
    state = TrainState()
    resumed_from = None
    if resume and (ckpt / "state.json").is_file():
        state, meta = load_checkpoint(ckpt, model, opt)
        if meta.get("total_steps") != total_steps or meta.get("draft_config") != dcfg.to_dict():
            raise ValueError(f"{ckpt}: checkpoint from a different run (schedule or draft shape differs)")
        resumed_from = state.step

    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else torch.autocast("cpu", enabled=False)
    stopped_early = False
    model.train()
    while state.epoch < tc.epochs:
        batches = _epoch_batches(ds, tc.token_budget, tc.seed, state.epoch)
        while state.batch_in_epoch < len(batches):
            if max_steps is not None and state.step >= max_steps:
                stopped_early = True
                break
            idx = batches[state.batch_in_epoch]
            batch = make_batch([ds[i] for i in idx], head, dev, tc.max_seq_len)
            lr = lr_at(state.step, total_steps, tc.lr, tc.warmup_ratio)
            for g in opt.param_groups:
                g["lr"] = lr
            with autocast:
                loss, stats = ttt_loss(model, batch, tc.ttt_steps, tc.ttt_decay)
            finite = bool(torch.isfinite(loss))
            gnorm = float("nan")
            if finite:
                loss.backward()
                gnorm = float(torch.nn.utils.clip_grad_norm_(trainable, tc.grad_clip))
                finite = math.isfinite(gnorm)
            if finite:
                opt.step()
                state.updates += 1
                state.consecutive_nan = 0
                _accumulate(state, stats)
            else:
                state.skipped_nan += 1
                state.consecutive_nan += 1
            opt.zero_grad(set_to_none=True)
            state.step += 1
            state.batch_in_epoch += 1
            if state.consecutive_nan >= MAX_CONSECUTIVE_NAN:
                raise TrainingDiverged(f"{state.consecutive_nan} non-finite steps in a row (last at step "
                                       f"{state.step}, {state.skipped_nan} skipped in all): check the data / lr")
            if on_progress is not None:
                on_progress({"step": state.step, "total_steps": total_steps, "epoch": state.epoch, "lr": lr,
                             "loss": float(loss.detach()) if finite else None, "grad_norm": gnorm,
                             "steps": stats, "skipped_nan": state.skipped_nan})
            if state.step % tc.checkpoint_every_steps == 0:
                save_checkpoint(ckpt, model, opt, state, extra)
        if stopped_early:
            break
        state.history.append(_epoch_metrics(state))
        state.epoch += 1
        state.batch_in_epoch = 0
        state.epoch_sums = {}
        write_metrics(out_dir, state.history)
        save_checkpoint(ckpt, model, opt, state, extra)

    if stopped_early:
        save_checkpoint(ckpt, model, opt, state, extra)
        return {"stage": "train", "complete": False, "step": state.step, "total_steps": total_steps,
                "checkpoint": str(ckpt)}

    from eagle3.export import export_vllm

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
        "wall_s": round(time.time() - started, 2),
    }
    write_json_atomic(out_dir / "manifest.json", manifest)
    return manifest


__all__ = [
    "Batch",
    "TargetHead",
    "TrainState",
    "TrainingDiverged",
    "load_target_head",
    "lr_at",
    "make_batch",
    "step_inputs",
    "target_distribution",
    "train",
    "ttt_loss",
    "ttt_mask",
    "ttt_unroll",
]
