"""Distributed training on CPU: 2 processes on gloo (torchrun) against one process.

The reference is one process with ``train.grad_accum = 2``: the same global batches (2 batches of
the epoch order per optimizer step), the same schedule. Tolerance, stated: per-step loss and
gradient norm relative 1e-4, final weights / AdamW state within atol 1e-5 + rtol 1e-4, all float32.
Measured (2026-12, torch 2.14 CPU): DDP bit-identical to the reference; FSDP loss 2e-8 and gradient
norm 2e-7 relative, weights 1.5e-8 and AdamW 1e-9 absolute (summation order of the reduce-scatter
and of the sharded gradient norm). Run with ``-s`` to see the numbers. About 35 s on 2 cores.

One torchrun launch (this file run as a script) does every distributed run: DDP, FSDP, and an FSDP
run stopped early, copied, then resumed under FSDP; the copy is resumed by one process here. A
second launch runs the real CLI (``torchrun -m eagle3.cli train``). The epoch has an odd number of
batches, so each epoch's last step leaves rank 1 without a batch (its zero-weight stand-in).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parent.parent
if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))

from tests.test_train import make_cfg, make_data, make_target, make_vocab  # noqa: E402

WORLD = 2
LOSS_RTOL = 1e-4
W_ATOL, W_RTOL = 1e-5, 1e-4
TRAIN = dict(epochs=2, token_budget=128, checkpoint_every_steps=2)
PART_STEPS = 4  # mid-epoch 2 (3 steps per epoch)


MUON = dict(optimizer="muon")  # the smollm2-sharegpt recipe's optimizer (eagle3/train/optim.py)


def cfg_for(mode: str = "ddp", grad_accum: int = 1, **train):
    return make_cfg(**{**TRAIN, **train}, distributed=mode, grad_accum=grad_accum)


def paths(tmp: Path) -> tuple[Path, Path, Path]:
    return tmp / "target", tmp / "extract", tmp / "vocab.safetensors"


def torchrun(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={WORLD}",
        *args,
    ]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{cmd} failed:\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    return p


def run_single(
    tmp: Path, out: Path, train_kw: dict | None = None, **kw
) -> tuple[dict, list[tuple[float, float]]]:
    """One process, grad_accum 2: (manifest, per-step (loss, grad norm before clipping))."""
    from eagle3.train import train

    log: list[tuple[float, float]] = []
    target, ext, vocab = paths(tmp)
    man = train(
        cfg_for(grad_accum=WORLD, **(train_kw or {})),
        ext,
        vocab,
        target,
        out,
        lambda p: log.append((p["loss"], p["grad_norm"])),
        **kw,
    )
    return man, log


def worker(tmp: Path) -> None:
    """Every distributed run, in one launch (one process group, which train() then leaves alone)."""
    import torch.distributed as dist

    from eagle3.train import train

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    target, ext, vocab = paths(tmp)

    def run(name: str, mode: str, train_kw: dict | None = None, **kw) -> dict:
        log: list[tuple[float, float]] = []
        man = train(
            cfg_for(mode, **(train_kw or {})),
            ext,
            vocab,
            target,
            tmp / name,
            lambda p: log.append((p["loss"], p["grad_norm"])),
            **kw,
        )
        if rank == 0:
            (tmp / f"{name}.json").write_text(json.dumps({"manifest": man, "log": log}))
        return man

    run("ddp", "ddp", {"prefetch": "on"})  # the loader thread (auto: CUDA only) on each rank
    run("fsdp", "fsdp")
    part = run("fsdp-part", "fsdp", max_steps=PART_STEPS)
    assert part["complete"] is False
    if rank == 0:
        shutil.copytree(tmp / "fsdp-part", tmp / "fsdp-part-copy")
    dist.barrier()
    run("fsdp-part", "fsdp")  # resumed under FSDP: every rank loads its shards from the full files
    dist.barrier()
    run("ddp-muon", "ddp", MUON)
    run("fsdp-muon", "fsdp", MUON)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """A tiny target, 16 samples of 20-40 tokens (5 batches of <= 128 tokens per epoch), a vocab."""
    tmp = tmp_path_factory.mktemp("train-dist")
    target, ext, vocab = paths(tmp)
    _, embed = make_target(target)
    make_data(ext, embed, n=16, seed=1)
    make_vocab(ext, vocab)
    return tmp


@pytest.fixture(scope="module")
def runs(data):
    tmp = data
    torchrun(str(Path(__file__)), "worker", str(tmp))
    single, log = run_single(tmp, tmp / "single")
    run_single(tmp, tmp / "single-muon", MUON)
    return tmp, single, log


def ckpt(run_dir: Path, name: str = "model") -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "checkpoints" / "latest" / f"{name}.safetensors"))


def assert_same_state(a: Path, b: Path) -> None:
    for name in ("model", "optimizer"):
        ta, tb = ckpt(a, name), ckpt(b, name)
        assert ta.keys() == tb.keys()
        for k in ta:
            torch.testing.assert_close(
                ta[k],
                tb[k],
                atol=W_ATOL,
                rtol=W_RTOL,
                msg=lambda m, name=name, k=k: f"{name} {k}: {m}",
            )
        worst = max(float((ta[k].double() - tb[k].double()).abs().max()) for k in ta)
        print(f"{a.name} vs {b.name}: {name} max abs difference {worst:.1e}")


def max_rel(xs: list[float], ys: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(xs, ys))


def test_accumulated_step_is_one_big_batch(data):
    """The loss normalisation: two micro-batches of different sizes (what two ranks, or two
    accumulation steps, hold) give the loss and the gradient of their concatenation as one batch.
    With SGD at lr 1 and no clipping the update is the gradient itself."""
    import contextlib

    from eagle3.draft import build_draft
    from eagle3.extract.storage import HiddenStateDataset
    from eagle3.train import (
        Dist,
        load_target_head,
        make_batch,
        train_step,
        ttt_loss,
        wrap_for_training,
    )
    from eagle3.vocab import load_vocab
    from tests.test_train import DRAFT_V

    target, ext, vocab = paths(data)
    ds = HiddenStateDataset(ext)
    head = load_target_head(target, load_vocab(vocab).draft_ids, 1e-5)
    cpu = torch.device("cpu")
    parts = [make_batch([ds[i] for i in idx], head, cpu, 64) for idx in ([0, 1], [2, 3, 4, 5, 6])]
    whole = make_batch([ds[i] for i in range(7)], head, cpu, 64)
    torch.manual_seed(0)
    ref = build_draft(target, DRAFT_V, [1, 2, 3], intermediate_size=128)
    model = build_draft(target, DRAFT_V, [1, 2, 3], intermediate_size=128)
    model.load_state_dict(ref.state_dict())
    loss, _ = ttt_loss(ref, whole, 2, 0.8)
    loss.backward()
    params = [p for p in model.parameters() if p.requires_grad]
    r = train_step(
        wrap_for_training(model, Dist(), cpu, 2, 0.8),
        torch.optim.SGD(params, lr=1.0),
        params,
        parts,
        Dist(),
        1e9,
        contextlib.nullcontext(),
    )
    assert r.finite and math.isclose(r.loss, float(loss.detach()), rel_tol=1e-5)
    ref_norm = float(
        torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.requires_grad], 1e9)
    )
    assert math.isclose(r.grad_norm, ref_norm, rel_tol=1e-4)
    for (n, a), b in zip(model.named_parameters(), ref.parameters()):
        if a.requires_grad:
            torch.testing.assert_close(
                a.detach(), (b - b.grad).detach(), atol=1e-6, rtol=1e-5, msg=n
            )


def test_epoch_has_a_short_last_group(runs):
    """The data gives an odd number of batches per epoch, so the zero-weight stand-in runs."""
    from eagle3.extract.storage import HiddenStateDataset

    tmp, single, _ = runs
    n = len(list(HiddenStateDataset(paths(tmp)[1]).batches(TRAIN["token_budget"])))
    assert n % WORLD == 1
    assert single["total_steps"] == math.ceil(n / WORLD) * TRAIN["epochs"]


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_distributed_matches_single_process(runs, mode):
    """Per-step loss and gradient norm (before clipping: the gradient's scale, which clipping and
    AdamW would otherwise hide) within rel 1e-4 of one process on the same global batches; same
    final weights and AdamW state; same per-epoch metrics."""
    tmp, single, log = runs
    got = json.loads((tmp / f"{mode}.json").read_text())
    man = got["manifest"]
    assert (
        man["complete"]
        and man["steps"] == single["steps"]
        and man["distributed"]["world_size"] == WORLD
    )
    assert man["distributed"]["mode"] == mode
    assert len(got["log"]) == len(log) == single["steps"]
    rel_loss = max_rel([x[0] for x in got["log"]], [x[0] for x in log])
    rel_norm = max_rel([x[1] for x in got["log"]], [x[1] for x in log])
    print(
        f"{mode}: max relative difference over {len(log)} steps: loss {rel_loss:.1e}, grad norm {rel_norm:.1e}"
    )
    assert rel_loss < LOSS_RTOL and rel_norm < LOSS_RTOL
    assert_same_state(tmp / mode, tmp / "single")
    ma = json.loads((tmp / mode / "metrics.json").read_text())["epochs"]
    mb = json.loads((tmp / "single" / "metrics.json").read_text())["epochs"]
    for ea, eb in zip(ma, mb):
        assert ea["top1"] == eb["top1"] and ea["tokens"] == eb["tokens"]
        assert max_rel(ea["loss"], eb["loss"]) < LOSS_RTOL
    assert (tmp / mode / "vllm-draft" / "model.safetensors").is_file()
    assert (tmp / mode / "metrics.png").is_file()


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_muon_distributed_matches_single_process(runs, mode):
    """train.optimizer=muon over 2 ranks: per-epoch losses within rel 1e-4 of one process. DDP
    also gives the same weights and optimizer state. torch.optim.Muon on FSDP's sharded weights
    orthogonalises each whole matrix (DTensor keeps the global semantics), but its bf16
    Newton-Schulz meets gradients reduced in another order, so there the weights agree to 1e-3
    (measured: 1.4e-4, 0.3% of the largest weight after 6 steps) rather than to 1e-5."""
    tmp, _, _ = runs
    got = json.loads((tmp / f"{mode}-muon.json").read_text())
    ref = json.loads((tmp / "single-muon" / "metrics.json").read_text())["epochs"]
    ma = json.loads((tmp / f"{mode}-muon" / "metrics.json").read_text())["epochs"]
    assert got["manifest"]["complete"] and len(ma) == len(ref)
    for ea, eb in zip(ma, ref):
        assert max_rel(ea["loss"], eb["loss"]) < LOSS_RTOL
    if mode == "ddp":
        assert_same_state(tmp / "ddp-muon", tmp / "single-muon")
        return
    a, b = ckpt(tmp / "fsdp-muon"), ckpt(tmp / "single-muon")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-3, rtol=0, msg=k)


def test_fsdp_checkpoint_resumes_in_one_process_and_under_fsdp(runs):
    """An FSDP checkpoint is the single-process format: one process (grad_accum 2) resumes it
    exactly, and so does FSDP itself (shards re-cut from the full files)."""
    tmp, single, _ = runs
    part = json.loads((tmp / "fsdp-part.json").read_text())["manifest"]
    assert part["complete"] and part["resumed_from_step"] == PART_STEPS
    assert_same_state(tmp / "fsdp-part", tmp / "single")
    man, _ = run_single(tmp, tmp / "fsdp-part-copy")
    assert (
        man["complete"]
        and man["resumed_from_step"] == PART_STEPS
        and man["steps"] == single["steps"]
    )
    assert_same_state(tmp / "fsdp-part-copy", tmp / "single")


def test_checkpoint_refuses_another_global_batch(runs):
    """A 2-rank checkpoint in one process without grad_accum 2 is a different schedule."""
    from eagle3.train import train

    tmp, _, _ = runs
    target, ext, vocab = paths(tmp)
    with pytest.raises(ValueError, match="world size x train.grad_accum = 2"):
        train(cfg_for(), ext, vocab, target, tmp / "fsdp-part-copy")


def test_cli_under_torchrun(runs):
    """`torchrun --nproc-per-node 2 -m eagle3.cli train` trains (DDP) the same draft as the runs above."""
    import yaml

    tmp, _, _ = runs
    target, ext, vocab = paths(tmp)
    data = cfg_for().model_dump(mode="json")
    data["target"]["model"] = str(target)
    data["paths"]["runs_dir"] = str(tmp / "runs")
    (tmp / "profile.yaml").write_text(yaml.safe_dump(data))
    p = torchrun(
        "-m",
        "eagle3.cli",
        "train",
        "-c",
        str(tmp / "profile.yaml"),
        "--extract-dir",
        str(ext),
        "--vocab-file",
        str(vocab),
        "--out",
        str(tmp / "cli"),
    )
    assert "vllm-draft" in p.stdout
    man = json.loads((tmp / "cli" / "manifest.json").read_text())
    assert (
        man["complete"]
        and man["distributed"]["world_size"] == WORLD
        and man["distributed"]["mode"] == "ddp"
    )
    a, b = ckpt(tmp / "cli"), ckpt(tmp / "ddp")
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=0, rtol=0)


def test_launcher_runs_torchrun_for_the_hero_run(runs):
    """train.nproc_per_node > 1: the Prefect task's launcher (eagle3.train.launch) starts torchrun itself
    and returns rank 0's manifest; same draft as the DDP run above."""
    from eagle3.train.launch import torchrun_train

    tmp, _, _ = runs
    target, ext, vocab = paths(tmp)
    cfg = cfg_for()
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"nproc_per_node": WORLD})})
    man = torchrun_train(cfg, ext, vocab, target, tmp / "launched", WORLD, log=lambda _: None)
    assert man["complete"] and man["distributed"]["world_size"] == WORLD
    assert (tmp / "launched" / "torchrun.log").stat().st_size > 0
    a, b = ckpt(tmp / "launched"), ckpt(tmp / "ddp")
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=0, rtol=0)


if __name__ == "__main__":
    assert sys.argv[1] == "worker"
    worker(Path(sys.argv[2]))
