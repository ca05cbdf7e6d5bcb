"""The REFERENCE trainer on OUR data: vllm-project/speculators' EAGLE-3 draft, trained by its own
trainer on one of our extract folders, written in our vLLM format so that ``eagle3.verify.offline``
(and vLLM) score it exactly like a draft of ``eagle3/train/`` (issue 14, item 3).

Bench only: it runs in ``.venv-ref`` here (``bench/reference/setup_env.sh``: CPU torch 2.13.0,
speculators 0.9.0, transformers 5.17.0) or on the GPU machine with the wheels of
``bench/reference/fetch_wheels.sh``; the pipeline never imports it.

Three steps (``all`` runs them in one process; each also runs alone)::

    convert  extract folder + vocab file  ->  OUT/data: speculators' training data format
    train    speculators.train.cli.main (its TrainConfig, data loader, Eagle3DraftModel, Trainer)
             -> OUT/checkpoints/<epoch>/ (its checkpoint: the speculators format)
    export   last checkpoint -> OUT/vllm-draft (eagle3.draft.export.export_vllm), checked against it

GPU command (one call from the repo root, device tool with ``carry: [".whl"]``; the H200 image has
torch 2.11, transformers 5.17, triton, pyarrow, ...; the wheels add speculators 0.9.0 and what it
needs that the image lacks; EXTRACT, VOCAB and TARGET are paths on that machine: an extract
folder, our vocab file (or its folder), the target's checkpoint folder)::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site && PYTHONUNBUFFERED=1 python3 bench/reference_speculators.py all --extract EXTRACT --vocab VOCAB --target TARGET --out /tmp/ref-run --epochs 10 --copy-to $OUT 2>&1 | tee $OUT/reference.log

Add ``--lr``, ``--ttt-steps``, ``--total-seq-len`` (tokens per step), ... to change the recipe, and
``--estimate-generate-dir GENERATE --estimate-max-sequences 32`` to score the trained draft there
with ``eagle3.verify.offline.offline_acceptance`` (the function ``eagle3 estimate-acceptance``
runs) on the GPU. The last line is ``REFERENCE step=all wall_s=... train_s=... out=/tmp/ref-run/vllm-draft
summary=...`` (wall_s: the whole command after the install; train_s: speculators' main() alone,
data loading, torch.compile and the per-epoch validation included). ``--copy-to $OUT`` brings back
summary.json (settings, timings, final metrics, estimate), metrics.jsonl (every metric record
speculators logged) and the vLLM-format draft (config + weights in 15 MiB parts: ``cat
vllm-draft.model.safetensors.part-* > model.safetensors``).

Data format (what speculators 0.9.0 reads, ``speculators/train/data.py``):

- ``OUT/data``: a ``datasets`` folder (``save_to_disk``, torch format) with one row per sample:
  ``input_ids`` [T] int64, ``loss_mask`` [T] int64 (1 = the token is an assistant token), ``seq_len``.
- ``OUT/data/hidden_states/hs_<row>.safetensors``: ``hidden_states`` [T, A+1, H] bfloat16 (the A
  aux layers in our layer order, then the last layer's output before the final norm, which is how
  vLLM's hidden-state connector writes them and how speculators splits them: ``[:, :-1]`` flattened
  is our ``aux`` [T, A*H], ``[:, -1]`` our ``final``) and ``token_ids`` [T] int64.
- ``OUT/data/d2t.npy``, ``t2d.npy``: our vocab file's mapping, unchanged (same convention:
  target id = i + d2t[i], t2d bool over the target vocab).
- speculators always holds out a validation split (``--train-data-ratio`` must be in (0, 1)): rows
  N.. are copies (symlinked hidden states) of the first few samples, and the ratio is chosen so that
  the training split is exactly our N samples; the validation numbers are therefore on training data.

What speculators does with it (read from its 0.9.0 source; ``shift_batch``, ``Eagle3DraftModel``,
``compute_metrics``): pairs the aux state at t with token t+1 and predicts the target's
distribution at t+1 (``verifier_lm_head(verifier_norm(final[t+1]))`` over the DRAFT vocab rows
only, softmax there), loss KL(target || draft) masked by ``loss_mask[t+1]`` (the INPUT token's
mask; ours masks by the predicted token's, one later, and also drops positions whose full-vocab
target argmax is outside the draft vocab); each TTT step feeds its output hidden state and the
ground-truth token one further, attending causally to step 0 and to its own diagonal (as ours).
Samples are packed into rows of ``--total-seq-len`` tokens (document-masked), one row per step.

Architecture: the draft built here has our draft's shape (the target's hidden, heads, KV heads,
head_dim, intermediate size, RoPE; one layer; draft vocab from our vocab file; aux layers from the
extract's manifest). speculators' eagle3 DEFAULTS add two things our model (``eagle3/draft/llama.py``)
does not have, so they are turned off here by default (``--arch eagle3``): ``norm_before_fc`` (an
RMSNorm over the concatenated 3H aux states before ``fc``) and ``norm_output`` (the NEXT TTT step,
and vLLM's next draft step, gets the post-norm hidden state). ``--arch eagle31`` keeps them
(speculators' true default); vLLM 0.32 serves that checkpoint (the speculators format), but our
offline evaluator cannot load it, so ``export`` then writes no vllm-draft and says so (the result
is the checkpoint folder). Also set: full
attention (``--full-attention-indices 0``; speculators' default is a 2048-token sliding window,
the same thing for samples shorter than 2048). ``norm_before_residual`` follows speculators'
default (True: the residual is the normed hidden state); ``--no-norm-before-residual`` gives ours.

speculators' default recipe (0.9.0, ``train/config/schema.py``) and ours (``eagle3/train/``):

==========================  ==========================================  ==================================
                            speculators 0.9.0 (defaults used here)      eagle3/train/ (TrainConfig)
==========================  ==========================================  ==================================
loss                        KL(target || draft) over the draft vocab    soft CE against the same
                            (same gradient as soft CE)                  distribution (renormalised)
loss positions              loss_mask of the input token t+1            mask of the predicted token t+2,
                                                                        and target argmax in draft vocab
TTT steps / weights         3 / 1.0 each (``ttt_step_loss_decay``)      7 / 0.8**i (smollm2-cpu: 3)
learning rate               1e-3 (both optimizer groups)                1e-4 (smollm2-cpu: 1e-3)
optimizer                   Muon (lr 1e-3, momentum 0.95, wd 0.1) on    AdamW betas 0.9/0.95, wd 0,
                            the 2-D layer matrices + AdamW (lr 1e-3,    no decay on norms
                            betas 0.9/0.999, wd 0.01) on the rest       (train.optimizer: muon = the left)
schedule                    linear warmup (1% of steps) + linear decay  warmup (2%) + cosine to 0
                                                                        (train.lr_schedule: linear)
grad clip                   1.0                                         0.5
lm_head                     target's lm_head rows of the draft vocab,   HEAD: random N(0, 0.02), trained
                            FROZEN (never trained); final norm from 1   (train.head_init: target +
                                                                        train.freeze_head: also the norm)
norm_before_residual        True                                        False (train.norm_before_residual)
norm_before_fc/norm_output  True / True (off here, see above)           not in the model
batch                       packed rows of 8192 tokens, 1 row per step  padded length buckets,
                                                                        token_budget 8192
epochs                      20                                          10 (smollm2-cpu: 20)
noise on the aux states     none                                        none (work in progress: option)
precision / kernels         bf16 autocast, fp32 master weights;         bf16 autocast, fp32 master
                            torch.compile'd forward, flex attention,    weights; eager PyTorch, SDPA
                            fused Triton loss                           with explicit TTT masks
validation                  every epoch on the held-out split (here:    none
                            copies of training samples, see above)
==========================  ==========================================  ==================================

Every default can be changed from this command line (``--lr``, ``--optimizer adamw``,
``--scheduler cosine``, ``--warmup-ratio``, ``--ttt-steps``, ``--ttt-decay``, ``--epochs``,
``--total-seq-len``), and any other speculators flag goes after ``--`` (``-- --muon-lr 0.02``).

CPU (the smoke test here): speculators' Trainer has no CPU path (it moves the model and the batches
to ``get_local_rank()`` = device index 0, i.e. cuda:0, and autocasts for "cuda"). On a machine
without an accelerator this script patches exactly three names: ``speculators.train.trainer
.get_local_rank`` and ``speculators.train.checkpointer.get_current_device`` return "cpu", and
``torch.accelerator.synchronize`` (called by the Trainer's step timer) does nothing; it passes
``--draft-attn-impl sdpa`` (flex attention needs torch.compile), ``--loss-implementation eager``
(the fused loss is Triton) and ``--hidden-states-dtype float32`` (autocast "cuda" is off on CPU, and
bf16 inputs would meet fp32 weights). Nothing is patched on CUDA.

Smoke test (CPU, here, about a minute)::

    .venv-ref/bin/python bench/reference_speculators.py all --extract /tmp/ref-smoke/extract \\
        --vocab /tmp/ref-smoke/vocab/vocab.safetensors --target ~/.cache/eagle3/models/smollm2-135m-instruct-* \\
        --out /tmp/ref-smoke/out --epochs 1 --max-steps 3 --total-seq-len 2048 \\
        --estimate-generate-dir /tmp/ref-smoke/generate --estimate-max-sequences 4
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # eagle3 without installing the project (the GPU machine)
    sys.path.insert(0, str(REPO))

DEFAULT_VAL_COPIES = 8


# ---------------------------------------------------------------------------------------------
# convert: our extract + vocab -> speculators' data folder
# ---------------------------------------------------------------------------------------------


def extract_aux_layers(extract: Path) -> list[int]:
    man = extract / "manifest.json"
    if not man.is_file():
        raise SystemExit(f"{extract}: no manifest.json (the aux layer ids are read from it)")
    layers = json.loads(man.read_text()).get("aux_layers")
    if not layers:
        raise SystemExit(f"{man}: no aux_layers")
    return [int(x) for x in layers]


def convert(
    extract: Path,
    vocab_path: Path,
    data_dir: Path,
    *,
    val_copies: int = DEFAULT_VAL_COPIES,
    total_seq_len: int | None = None,
) -> dict[str, Any]:
    """Write ``data_dir`` in speculators' format (module docstring); returns what was written."""
    import numpy as np
    import torch
    from datasets import Dataset
    from datasets.table import InMemoryTable
    from safetensors.torch import save_file

    from eagle3.extract.storage import HiddenStateDataset
    from eagle3.vocab import load_vocab

    t0 = time.time()
    vocab = load_vocab(vocab_path)
    ds = HiddenStateDataset(extract, dtype=torch.bfloat16)  # fp8 shards come back dequantised
    n = len(ds)
    if n < 2:
        raise SystemExit(f"{extract}: {n} samples; need at least 2")
    aux_layers = extract_aux_layers(extract)
    if data_dir.exists():
        shutil.rmtree(data_dir)
    hs_dir = data_dir / "hidden_states"
    hs_dir.mkdir(parents=True)
    rows: dict[str, list] = {"input_ids": [], "loss_mask": [], "seq_len": []}
    tokens = loss_tokens = 0
    longest = 0
    hidden = None
    for i in range(n):
        s = ds[i]
        t = len(s)
        h = s.final.shape[-1]
        if s.aux.shape[-1] != len(aux_layers) * h:
            raise SystemExit(
                f"sample {s.id}: aux width {s.aux.shape[-1]} != {len(aux_layers)} x {h}"
            )
        hidden = h
        states = torch.cat([s.aux.reshape(t, len(aux_layers), h), s.final.reshape(t, 1, h)], dim=1)
        save_file(
            {
                "hidden_states": states.to(torch.bfloat16).contiguous(),
                "token_ids": s.input_ids.to(torch.int64).contiguous(),
            },
            str(hs_dir / f"hs_{i}.safetensors"),
        )
        rows["input_ids"].append(s.input_ids.to(torch.int64).tolist())
        rows["loss_mask"].append(s.loss_mask.to(torch.int64).tolist())
        rows["seq_len"].append(t)
        tokens += t
        loss_tokens += int(s.loss_mask.sum())
        longest = max(longest, t)
    if total_seq_len is not None and longest > total_seq_len:
        raise SystemExit(
            f"the longest sample has {longest} tokens > --total-seq-len {total_seq_len}: "
            "speculators' packer would drop it"
        )
    # The validation split speculators insists on: copies of the first samples, after all N.
    k = max(1, min(val_copies, n))
    for j in range(k):
        for key in rows:
            rows[key].append(rows[key][j])
        os.symlink(f"hs_{j}.safetensors", hs_dir / f"hs_{n + j}.safetensors")
    m = n + k
    ratio = (n + 0.5) / m
    if int(m * ratio) != n:
        raise AssertionError("train split size")
    # An explicit fingerprint: Dataset.from_dict would hash the in-memory Arrow table with dill,
    # which failed in a GPU-like layout (PicklingError on pyarrow's MonthDayNano); nothing here
    # needs datasets' content hash (no cache is used).
    fingerprint = hashlib.sha256(
        (extract / "index.json").read_bytes() + vocab_path.read_bytes()[: 1 << 20] + str(k).encode()
    ).hexdigest()[:16]
    d = Dataset(InMemoryTable.from_pydict(rows), fingerprint=fingerprint)
    d.set_format(type="torch")
    d.save_to_disk(str(data_dir))
    np.save(data_dir / "d2t.npy", vocab.d2t.to(torch.int64).numpy())
    np.save(data_dir / "t2d.npy", vocab.t2d.to(torch.bool).numpy())
    info = {
        "samples": n,
        "val_copies": k,
        "train_data_ratio": ratio,
        "tokens": tokens,
        "loss_tokens": loss_tokens,
        "longest": longest,
        "hidden_size": hidden,
        "aux_layers": aux_layers,
        "draft_vocab_size": vocab.draft_vocab_size,
        "target_vocab_size": vocab.target_vocab_size,
        "extract": str(extract),
        "vocab": str(vocab_path),
        "convert_s": round(time.time() - t0, 2),
    }
    (data_dir / "eagle3-convert.json").write_text(json.dumps(info, indent=2) + "\n")
    print(
        f"convert: {n} samples ({tokens} tokens, {loss_tokens} with loss, longest {longest}) + {k} validation "
        f"copies -> {data_dir} in {info['convert_s']} s",
        flush=True,
    )
    return info


# ---------------------------------------------------------------------------------------------
# train: speculators' own entry point
# ---------------------------------------------------------------------------------------------


class _MetricsFile(logging.Handler):
    """Every dict speculators logs on ``speculators.metrics`` as one JSON line; a short console line
    every ``every`` training steps and for every validation record."""

    def __init__(self, path: Path, every: int) -> None:
        super().__init__()
        self.f = open(path, "a")
        self.every = max(1, every)
        self.last: dict[str, Any] = {}

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.msg
        if not isinstance(msg, dict):
            return
        self.f.write(json.dumps(msg, default=str) + "\n")
        self.f.flush()
        if "train" in msg:
            self.last = msg
            step = int(msg.get("global_step", 0))
            if step % self.every == 0:
                tr = msg["train"]
                accs = " ".join(f"{tr[k]:.3f}" for k in sorted(tr) if k.startswith("full_acc_"))
                print(
                    f"  step {step} epoch {msg.get('epoch')} lr {msg.get('lr')} loss {tr.get('loss', float('nan')):.4f} "
                    f"full_acc {accs}",
                    flush=True,
                )
        elif "val" in msg:
            v = msg["val"]
            accs = " ".join(f"{v[k]:.3f}" for k in sorted(v) if k.startswith("full_acc_"))
            print(
                f"  validation epoch {msg.get('epoch')}: loss {v.get('loss_epoch', float('nan')):.4f} full_acc {accs}",
                flush=True,
            )


def _setup_logging(out: Path, every: int) -> _MetricsFile:
    """Our handlers on the root logger BEFORE speculators' setup_root_logger (whose basicConfig is
    then a no-op): plain console lines instead of a Rich dict per step, metrics to a file."""
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    console = logging.StreamHandler(sys.stdout)
    console.setFormatter(
        logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s", "%H:%M:%S")
    )
    console.addFilter(lambda r: not isinstance(r.msg, dict))
    root.addHandler(console)
    metrics = _MetricsFile(out / "metrics.jsonl", every)
    root.addHandler(metrics)
    root.setLevel(logging.INFO)
    return metrics


def _patch_for_cpu() -> None:
    """speculators' Trainer puts the model and batches on device index 0 (cuda:0), loads
    checkpoints onto "cuda:0" when there is no accelerator, and its step timer calls
    ``torch.accelerator.synchronize()``, which raises without one: point the first two at the CPU
    and make the third a no-op (nothing to wait for on the CPU). Only without an accelerator."""
    import speculators.train.checkpointer as checkpointer
    import speculators.train.trainer as trainer
    import torch

    trainer.get_local_rank = lambda: "cpu"  # type: ignore[assignment]
    checkpointer.get_current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.accelerator.synchronize = lambda *_a, **_k: None  # type: ignore[assignment]


def speculators_argv(
    a: argparse.Namespace, info: dict[str, Any], data_dir: Path, ckpt_dir: Path, cpu: bool
) -> list[str]:
    argv = [
        "--speculator-type",
        "eagle3",
        "--verifier-name-or-path",
        str(a.target),
        "--data-path",
        str(data_dir),
        "--hidden-states-backend",
        "file",
        "--on-missing",
        "raise",  # never try to reach a vLLM server for a missing sample
        "--train-data-ratio",
        repr(info["train_data_ratio"]),
        "--save-path",
        str(ckpt_dir),
        "--log-dir",
        str(a.out / "logs"),
        "--no-resume-from-checkpoint",
        "--draft-vocab-size",
        str(info["draft_vocab_size"]),
        "--d2t-path",
        str(data_dir / "d2t.npy"),
        "--t2d-path",
        str(data_dir / "t2d.npy"),
        "--target-layer-ids",
        *[str(x) for x in info["aux_layers"]],
        "--full-attention-indices",
        "0",
        "--total-seq-len",
        str(a.total_seq_len),
        "--epochs",
        str(a.epochs),
        "--lr",
        repr(a.lr),
        "--ttt-steps",
        str(a.ttt_steps),
        "--ttt-step-loss-decay",
        repr(a.ttt_decay),
        "--optimizer",
        a.optimizer,
        "--scheduler-type",
        a.scheduler,
        "--seed",
        str(a.seed),
        "--num-workers",
        str(0 if cpu else a.num_workers),
        "--log-freq",
        str(a.log_freq),
        "--norm-before-residual" if a.norm_before_residual else "--no-norm-before-residual",
    ]
    if a.arch == "eagle3":
        argv += ["--no-norm-before-fc", "--no-norm-output"]
    if a.weight_decay is not None:
        argv += ["--weight-decay", repr(a.weight_decay)]
    if a.warmup_ratio is not None:
        argv += ["--scheduler-warmup-ratio", repr(a.warmup_ratio)]
    if a.max_steps is not None:
        argv += ["--max-steps", str(a.max_steps)]
    if cpu:
        argv += [
            "--draft-attn-impl",
            "sdpa",
            "--loss-implementation",
            "eager",
            "--hidden-states-dtype",
            "float32",
        ]
    return argv + list(a.extra)


def train(a: argparse.Namespace, info: dict[str, Any]) -> dict[str, Any]:
    import torch
    from speculators.train.cli import main as speculators_main
    from speculators.train.config import TrainConfig

    data_dir, ckpt_dir = a.out / "data", a.out / "checkpoints"
    cpu = not torch.cuda.is_available()
    if ckpt_dir.exists():
        shutil.rmtree(ckpt_dir)
    argv = speculators_argv(a, info, data_dir, ckpt_dir, cpu)
    print("speculators train " + " ".join(argv), flush=True)
    metrics = _setup_logging(a.out, a.print_every)
    if cpu:
        _patch_for_cpu()
    cfg = TrainConfig.resolve(argv)
    t0 = time.time()
    speculators_main(cfg)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    train_s = time.time() - t0
    return {
        "argv": argv,
        "device": "cuda" if not cpu else "cpu",
        "train_s": round(train_s, 2),
        "last_train_metrics": metrics.last,
        "resolved": cfg.model_dump(mode="json"),
    }


# ---------------------------------------------------------------------------------------------
# export: speculators checkpoint -> our vLLM format
# ---------------------------------------------------------------------------------------------


def last_checkpoint(ckpt_dir: Path) -> Path:
    epochs = [
        int(d.name)
        for d in ckpt_dir.iterdir()
        if d.is_dir() and not d.is_symlink() and d.name.isdigit()
    ]
    if not epochs:
        raise SystemExit(f"{ckpt_dir}: no epoch checkpoint")
    path = ckpt_dir / str(max(epochs))
    if not (path / "model.safetensors").is_file() or not (path / "config.json").is_file():
        raise SystemExit(f"{path}: no model.safetensors + config.json")
    return path


def to_eagle3_draft(ckpt: Path, target: Path, vocab_path: Path, aux_layers: list[int]):
    """Our Eagle3Draft holding the speculators checkpoint's weights (refuses what it cannot hold)."""
    import torch
    from safetensors.torch import load_file

    from eagle3.draft import DraftConfig, Eagle3Draft
    from eagle3.target_checkpoint import EMBED_NAMES, load_target_tensor
    from eagle3.vocab import load_vocab

    conf = json.loads((ckpt / "config.json").read_text())
    if conf.get("speculators_model_type") != "eagle3":
        raise SystemExit(f"{ckpt}: not an eagle3 speculators checkpoint")
    extra = [f for f in ("norm_before_fc", "fc_norm", "norm_output") if conf.get(f)]
    if extra:
        raise SystemExit(
            f"{ckpt}: trained with {extra} (speculators' eagle3 defaults), which eagle3/draft/llama.py does "
            "not implement, so eagle3.verify.offline cannot score it; vLLM 0.32 serves the speculators "
            f"checkpoint itself ({ckpt}). Train with --arch eagle3 for a draft both evaluations read."
        )
    tl = conf["transformer_layer_config"]
    if int(tl.get("num_hidden_layers", 1)) != 1:
        raise SystemExit(f"{ckpt}: {tl.get('num_hidden_layers')} draft layers; our format has one")
    layer_types = tl.get("layer_types") or []
    if "sliding_attention" in layer_types:
        print(
            f"export: warning: the draft layer was trained with a {tl.get('sliding_window')}-token sliding window; "
            "our format has full attention (the same for shorter sequences)",
            flush=True,
        )
    vocab = load_vocab(vocab_path)
    cfg = DraftConfig.from_target(
        target,
        vocab.draft_vocab_size,
        aux_layers,
        norm_before_residual=bool(conf.get("norm_before_residual", False)),
    )
    for ours, theirs in (
        ("hidden_size", "hidden_size"),
        ("intermediate_size", "intermediate_size"),
        ("num_attention_heads", "num_attention_heads"),
        ("num_key_value_heads", "num_key_value_heads"),
        ("head_dim", "head_dim"),
        ("vocab_size", "vocab_size"),
    ):
        a_, b_ = getattr(cfg, ours), tl.get(theirs)
        if b_ is not None and int(a_) != int(b_):
            raise SystemExit(f"{ckpt}: {theirs} {b_} != our draft's {a_}")
    if not math.isclose(float(cfg.rms_norm_eps), float(tl.get("rms_norm_eps", cfg.rms_norm_eps))):
        raise SystemExit(f"{ckpt}: rms_norm_eps {tl.get('rms_norm_eps')} != {cfg.rms_norm_eps}")
    theirs_theta = (tl.get("rope_parameters") or {}).get("rope_theta", tl.get("rope_theta"))
    if theirs_theta is not None and not math.isclose(float(theirs_theta), cfg.rope_theta):
        raise SystemExit(f"{ckpt}: rope_theta {theirs_theta} != {cfg.rope_theta}")
    if int(conf["draft_vocab_size"]) != cfg.draft_vocab_size:
        raise SystemExit(
            f"{ckpt}: draft vocab {conf['draft_vocab_size']} != {cfg.draft_vocab_size}"
        )
    if list(conf.get("eagle_aux_hidden_state_layer_ids") or aux_layers) != aux_layers:
        raise SystemExit(
            f"{ckpt}: aux layers {conf.get('eagle_aux_hidden_state_layer_ids')} != {aux_layers}"
        )

    tensors = load_file(str(ckpt / "model.safetensors"))
    d2t, t2d = tensors.pop("d2t"), tensors.pop("t2d")
    if not torch.equal(d2t.to(torch.int64), vocab.d2t.to(torch.int64)) or not torch.equal(
        t2d.bool(), vocab.t2d.bool()
    ):
        raise SystemExit(f"{ckpt}: d2t/t2d differ from {vocab_path}")
    embed = tensors.pop("embed_tokens.weight", None)
    if (
        embed is not None
    ):  # frozen copy of the target's: check, do not export (vLLM shares the target's)
        ref = load_target_tensor(target, EMBED_NAMES)
        if not torch.allclose(embed.float(), ref.float(), atol=1e-2, rtol=1e-2):
            raise SystemExit(f"{ckpt}: embed_tokens differs from the target's")
    state = {
        ("midlayer." + k[len("layers.0.") :] if k.startswith("layers.0.") else k): v
        for k, v in tensors.items()
    }
    model = Eagle3Draft(cfg)
    missing, unexpected = model.load_state_dict(
        {k: v.float() for k, v in state.items()}, strict=False
    )
    missing = [k for k in missing if not k.startswith("embed_tokens.")]
    if missing or unexpected:
        raise SystemExit(
            f"{ckpt}: weights do not map onto our draft: missing {missing}, unexpected {unexpected}"
        )
    return model, cfg, vocab, conf


def export(a: argparse.Namespace, aux_layers: list[int]) -> dict[str, Any]:
    from eagle3.draft.export import export_vllm, load_exported

    ckpt = last_checkpoint(a.out / "checkpoints")
    out = a.out / "vllm-draft"
    conf = json.loads((ckpt / "config.json").read_text())
    extra = [f for f in ("norm_before_fc", "fc_norm", "norm_output") if conf.get(f)]
    if extra:  # --arch eagle31: nothing our format holds; the speculators checkpoint is the result
        if out.exists():
            shutil.rmtree(out)
        msg = (
            f"not exported: trained with {extra}, which eagle3/draft/llama.py does not implement (so "
            f"eagle3.verify.offline cannot score it); vLLM 0.32 serves the speculators checkpoint {ckpt} itself"
        )
        print("export: " + msg, flush=True)
        return {"checkpoint": str(ckpt), "vllm_draft": None, "skipped": msg}
    model, cfg, vocab, conf = to_eagle3_draft(ckpt, a.target, a.vocab, aux_layers)
    meta = {
        "trainer": "speculators",
        "speculators_checkpoint": str(ckpt),
        "norm_before_residual": cfg.norm_before_residual,
    }
    export_vllm(model, cfg, vocab.d2t, vocab.t2d, out, metadata=meta)
    load_exported(out)  # reads back through the same loader the offline estimate uses
    print(f"export: {ckpt} -> {out}", flush=True)
    result: dict[str, Any] = {"checkpoint": str(ckpt), "vllm_draft": str(out)}
    if a.check_samples > 0:
        result["equivalence"] = check_equivalence(
            ckpt, out, a.target, a.extract, a.check_samples, a.ttt_steps
        )
    return result


def check_equivalence(
    ckpt: Path, draft_dir: Path, target: Path, extract: Path, samples: int, ttt_steps: int
) -> dict[str, Any]:
    """The converted draft must compute what speculators' model computes: run both (float32, CPU,
    eager) on the first samples of the extract, TTT-unrolled ``ttt_steps`` steps with ground-truth
    inputs, and compare the logits per step (speculators' via a hook on its lm_head)."""
    import torch
    from speculators.models.eagle3 import Eagle3DraftModel

    from eagle3.draft.export import load_exported
    from eagle3.extract.storage import HiddenStateDataset

    config = Eagle3DraftModel.config_class.from_pretrained(str(ckpt))
    config.transformer_layer_config._attn_implementation = "sdpa"  # noqa: SLF001 (eager SDPA, no compile)
    ref = Eagle3DraftModel.from_pretrained(str(ckpt), config=config).float().eval()
    captured: list[torch.Tensor] = []
    hook = ref.lm_head.register_forward_hook(lambda _m, _i, o: captured.append(o.detach()))
    forward = getattr(type(ref).forward, "__wrapped__", type(ref).forward)  # skip torch.compile
    ours, _, _ = load_exported(draft_dir, dtype=torch.float32)
    ours.load_embeddings(target)
    ours.eval()
    ds = HiddenStateDataset(extract, dtype=torch.float32)
    worst = [0.0] * ttt_steps
    agree = [[0, 0] for _ in range(ttt_steps)]
    with torch.no_grad():
        for j in range(min(samples, len(ds))):
            s = ds[j]
            t = min(len(s), 512)
            ids, aux = s.input_ids[:t].long(), s.aux[:t].float()
            x, h = ids[1:][None], aux[:-1][None]  # speculators' shift_batch: (x_{t+1}, a_t)
            n = x.shape[1]
            captured.clear()
            forward(
                ref,
                hidden_states=h,
                input_ids=x,
                document_ids=torch.zeros(1, n, dtype=torch.long),
                ttt_steps=ttt_steps,
            )
            hidden, past = h, None
            pos = torch.arange(n)
            for i in range(ttt_steps):
                xi = torch.cat([x[:, i:], x.new_zeros(1, i)], dim=1)
                mask = (
                    None
                    if i == 0
                    else torch.cat(
                        [torch.ones(n, n, dtype=torch.bool).tril()]
                        + [torch.eye(n, dtype=torch.bool)] * i,
                        dim=1,
                    )
                )
                out, logits, kv = ours(
                    xi, hidden, position_ids=pos + i, attn_mask=mask, past_kv=past, use_cache=True
                )
                past = (
                    kv
                    if past is None
                    else (torch.cat([past[0], kv[0]], 2), torch.cat([past[1], kv[1]], 2))
                )
                hidden = out
                valid = n - i  # positions whose inputs are real tokens
                a_, b_ = logits[0, :valid], captured[i][0, :valid].float()
                worst[i] = max(
                    worst[i], float((a_ - b_).abs().max() / b_.abs().max().clamp(min=1e-6))
                )
                agree[i][0] += int((a_.argmax(-1) == b_.argmax(-1)).sum())
                agree[i][1] += valid
    hook.remove()
    res = {
        "samples": min(samples, len(ds)),
        "max_rel_logit_diff_per_step": worst,
        "argmax_agreement_per_step": [c / max(1, tot) for c, tot in agree],
    }
    print(
        f"export check vs speculators' own forward: max |dlogit|/max|logit| per TTT step "
        f"{[f'{w:.1e}' for w in worst]}, argmax agreement {[f'{v:.4f}' for v in res['argmax_agreement_per_step']]}",
        flush=True,
    )
    if max(worst) > 1e-3:
        raise SystemExit("the converted draft does not compute what speculators' model computes")
    return res


# ---------------------------------------------------------------------------------------------
# optional: the offline acceptance estimate (the evaluation our trainer's drafts get)
# ---------------------------------------------------------------------------------------------


def estimate(a: argparse.Namespace) -> dict[str, Any]:
    import torch

    from eagle3.generate.storage import iter_samples
    from eagle3.verify.offline import offline_acceptance

    seqs = []
    for s in iter_samples(a.estimate_generate_dir):
        seqs.append((s["prompt_token_ids"], s["completion_token_ids"]))
        if len(seqs) >= a.estimate_max_sequences:
            break
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.time()
    r = offline_acceptance(a.target, a.out / "vllm-draft", seqs, a.estimate_k, device=device)
    r["estimate_s"] = round(time.time() - t0, 2)
    r["generate_dir"] = str(a.estimate_generate_dir)
    print(
        "offline estimate (eagle3.verify.offline.offline_acceptance): " + json.dumps(r), flush=True
    )
    return r


def copy_results(out: Path, dest: Path, part_bytes: int = 15 << 20) -> None:
    """summary.json, metrics.jsonl and the exported draft into ``dest`` (flat, for the device
    tool's $OUT: at most 16 MiB a file, so the draft's weights go in 15 MiB parts; rebuild with
    ``cat vllm-draft.model.safetensors.part-* > vllm-draft/model.safetensors``)."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("summary.json", "metrics.jsonl"):
        if (out / name).is_file():
            shutil.copy2(out / name, dest / name)
    draft = out / "vllm-draft"
    if (draft / "config.json").is_file():
        shutil.copy2(draft / "config.json", dest / "vllm-draft.config.json")
        with open(draft / "model.safetensors", "rb") as f:
            for i in range(10_000):
                chunk = f.read(part_bytes)
                if not chunk:
                    break
                (dest / f"vllm-draft.model.safetensors.part-{i:02d}").write_bytes(chunk)
    what = (
        "summary, metrics and the draft (config + weights in parts)"
        if (draft / "config.json").is_file()
        else "summary and metrics (no vllm-draft)"
    )
    print(f"copied {what} to {dest}", flush=True)


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="More speculators train flags go after --, e.g. -- --muon-lr 0.02",
    )
    p.add_argument("step", choices=("all", "convert", "train", "export", "estimate"))
    p.add_argument(
        "--extract",
        type=Path,
        required=True,
        help="our extract folder (hidden-*.safetensors + index.json)",
    )
    p.add_argument(
        "--vocab",
        type=Path,
        required=True,
        help="our vocab file (vocab.safetensors, or its folder)",
    )
    p.add_argument(
        "--target",
        type=Path,
        required=True,
        help="the target's checkpoint folder (config.json, weights)",
    )
    p.add_argument(
        "--out",
        type=Path,
        required=True,
        help="output folder (data/, checkpoints/, vllm-draft/, ...)",
    )
    g = p.add_argument_group("training (defaults: speculators 0.9.0's)")
    g.add_argument("--epochs", type=int, default=20)
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--ttt-steps", type=int, default=3)
    g.add_argument(
        "--ttt-decay", type=float, default=1.0, help="loss weight of TTT step i is decay**i"
    )
    g.add_argument(
        "--total-seq-len", type=int, default=8192, help="tokens per packed row = per optimizer step"
    )
    g.add_argument("--optimizer", choices=("muon", "adamw"), default="muon")
    g.add_argument("--scheduler", choices=("linear", "cosine", "none"), default="linear")
    g.add_argument(
        "--warmup-ratio", type=float, default=None, help="default: speculators' 1%% of the steps"
    )
    g.add_argument("--weight-decay", type=float, default=None, help="AdamW group (default 0.01)")
    g.add_argument(
        "--max-steps",
        type=int,
        default=None,
        help="stop after this many optimizer steps (smoke tests)",
    )
    g.add_argument("--seed", type=int, default=42)
    g.add_argument(
        "--arch",
        choices=("eagle3", "eagle31"),
        default="eagle3",
        help="eagle3: norm_before_fc and norm_output off (what our model and evaluator hold); "
        "eagle31: speculators' defaults (not scorable by eagle3.verify.offline)",
    )
    g.add_argument(
        "--norm-before-residual",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="speculators' default True; our trainer's False",
    )
    g.add_argument(
        "--num-workers", type=int, default=8, help="data loader workers on CUDA (CPU: 0)"
    )
    g.add_argument(
        "--log-freq", type=int, default=10, help="speculators logs (and syncs) every N steps"
    )
    g.add_argument("--print-every", type=int, default=50, help="console line every N steps")
    g.add_argument("--val-copies", type=int, default=DEFAULT_VAL_COPIES)
    g.add_argument(
        "--check-samples",
        type=int,
        default=2,
        help="export: compare the converted draft with speculators' forward on N samples (0: skip)",
    )
    e = p.add_argument_group("offline estimate (optional)")
    e.add_argument(
        "--estimate-generate-dir",
        type=Path,
        default=None,
        help="score the exported draft on these generated sequences (eagle3.verify.offline)",
    )
    e.add_argument("--estimate-max-sequences", type=int, default=32)
    e.add_argument("--estimate-k", type=int, default=3)
    p.add_argument(
        "--copy-to",
        type=Path,
        default=None,
        help="also copy summary.json, metrics.jsonl and the draft (weights in 15 MiB parts) here ($OUT)",
    )
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:  # after --: more speculators train flags, passed as they are
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    a = p.parse_args(argv)
    a.extra = extra
    if a.vocab.is_dir():
        a.vocab = a.vocab / "vocab.safetensors"
    a.target = a.target.expanduser().resolve()
    return a


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    summary_path = a.out / "summary.json"
    summary: dict[str, Any] = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    aux_layers = extract_aux_layers(a.extract)
    if a.step in ("all", "convert"):
        summary["convert"] = convert(
            a.extract,
            a.vocab,
            a.out / "data",
            val_copies=a.val_copies,
            total_seq_len=a.total_seq_len,
        )
    if a.step in ("all", "train"):
        info = summary.get("convert") or json.loads(
            (a.out / "data" / "eagle3-convert.json").read_text()
        )
        summary["train"] = train(a, info)
    if a.step in ("all", "export"):
        summary["export"] = export(a, aux_layers)
    if (
        a.step in ("all", "estimate")
        and a.estimate_generate_dir is not None
        and (a.out / "vllm-draft").is_dir()
    ):
        summary["estimate"] = estimate(a)
    from importlib.metadata import version

    summary["versions"] = {n: version(n) for n in ("speculators", "torch", "transformers")}
    summary["wall_s"] = round(time.time() - t0, 2)
    summary_path.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    if a.copy_to is not None:
        copy_results(a.out, a.copy_to)
    train_s = summary.get("train", {}).get("train_s")
    result = (
        a.out / "vllm-draft"
        if (a.out / "vllm-draft").is_dir()
        else summary.get("export", {}).get("checkpoint")
    )
    print(
        f"REFERENCE step={a.step} wall_s={summary['wall_s']} train_s={train_s} out={result} "
        f"summary={summary_path}",
        flush=True,
    )


if __name__ == "__main__":
    main()
