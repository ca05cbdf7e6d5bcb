"""Online states (``extract.states: online``): train asks the target for each batch's states.

Real parts throughout: the embedded SmolLM2 in transformers (the ``hf`` source) and a real vLLM
CPU server (the ``vllm`` source), on the checked-in generate output (8 real samples). Each online
run is compared with the offline run of the same samples, seed and recipe.

Tolerances (measured here, fp32 on the CPU): the in-process target gives per-step epoch losses
within 4e-7 relative of the offline (bound: 4e-6) run's: the states go through the same bf16 rounding as the
store, and the target's forward differs from extract's only by the batch it ran in (ulps before
the rounding). The vLLM source: the states are the server's in both runs, but its batching
differs between extract and train, so the bound is 1e-4 relative.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import CPU_PROFILE, ROOT, gen_cfg, require_vllm

BASE = [
    "train.epochs=2",
    "train.lr=1e-3",
    "train.token_budget=512",
    "vocab.draft_vocab_size=512",
]
ONLINE = ["extract.states=online", "train.state_cache_gib=0.001"]  # ~1 MB: about a third fits


def losses(train_dir: Path) -> list[list[float]]:
    return [e["loss"] for e in json.loads((train_dir / "metrics.json").read_text())["epochs"]]


def assert_losses_close(a: Path, b: Path, rel: float) -> float:
    worst = 0.0
    for la, lb in zip(losses(a), losses(b), strict=True):
        for x, y in zip(la, lb, strict=True):
            worst = max(worst, abs(x - y) / abs(x))
    assert worst <= rel, worst
    return worst


@pytest.fixture(scope="module")
def offline(gen_dir, smol_model, tmp_path_factory):
    """The offline run: hf extract (states stored), vocab, train."""
    from eagle3.extract.runner import extract
    from eagle3.train import train
    from eagle3.vocab import vocab_stage

    root = tmp_path_factory.mktemp("offline")
    cfg = gen_cfg(root, *BASE)
    extract(cfg, gen_dir, root / "extract", str(smol_model))
    vocab_stage(root / "extract", root / "vocab", 49152, 512)
    train(cfg, root / "extract", root / "vocab" / "vocab.safetensors", smol_model, root / "train")
    return root


def test_online_hf_matches_offline_within_its_cache(offline, gen_dir, smol_model, tmp_path):
    """Extract stores tokens only (the vocab stage's key is unchanged); train with the target in
    its own process gives the offline run's losses, reuses the cache in epoch 2, and never holds
    more than the budget on disk."""
    from eagle3.extract.runner import extract
    from eagle3.extract.storage import tokens_key
    from eagle3.train import train
    from eagle3.train.online import disk_bytes

    cfg = gen_cfg(tmp_path, *BASE, *ONLINE)
    m = extract(cfg, gen_dir, tmp_path / "extract", str(smol_model))
    off = json.loads((offline / "extract" / "manifest.json").read_text())
    assert m["states"] == "online" and m["samples"] == off["samples"] == 8
    assert m["bytes_per_token"] < 20 < 1000 < off["bytes_per_token"]  # ids + mask vs 4.6 KB
    assert tokens_key(tmp_path / "extract", "g") == tokens_key(offline / "extract", "g")

    vocab = offline / "vocab" / "vocab.safetensors"
    man = train(cfg, tmp_path / "extract", vocab, smol_model, tmp_path / "train")
    worst = assert_losses_close(offline / "train", tmp_path / "train", 4e-6)
    print(f"\nonline hf vs offline: worst per-step epoch loss difference {worst:.1e} relative")
    a = load_file(str(offline / "train" / "checkpoints" / "latest" / "model.safetensors"))
    b = load_file(str(tmp_path / "train" / "checkpoints" / "latest" / "model.safetensors"))
    for k in a:  # a handful of weights move an ulp of a state apart: compare whole tensors
        assert float((a[k] - b[k]).norm() / a[k].norm()) < 1e-4, k

    st = man["states"]
    budget = int(0.001 * 1024**3)
    assert st["mode"] == "online" and st["backend"] == "hf"
    assert 0 < st["cache_peak_bytes"] <= st["cache_budget_bytes"] == budget
    assert disk_bytes(tmp_path / "train" / "state-cache") <= budget + 4096  # + cache.json
    # epoch 1 computes all 8; epoch 2 reads what fits, computes the rest
    assert st["cache_hits"] > 0 and st["produced"] == 16 - st["cache_hits"]


def test_state_cache_budget_settings_and_torn_files(tmp_path):
    from eagle3.train.online import StateCache, from_stored, stored_form

    x = torch.randn(100, 120)
    stored = stored_form(x, x[:, :4], "bfloat16")
    one = sum(t.numel() * t.element_size() for t in stored.values()) + 1024
    c = StateCache(tmp_path / "c", 2 * one, {"k": 1})
    assert c.put("a", stored) and c.put("b", stored) and not c.put("c", stored)  # full
    assert c.bytes <= 2 * one and c.get("c") is None
    aux, final = from_stored(c.get("a"), torch.float32)
    assert torch.equal(aux, x.to(torch.bfloat16).float())
    (tmp_path / "c" / "x.safetensors.tmp").write_bytes(b"torn")  # a write a kill cut short
    again = StateCache(tmp_path / "c", 2 * one, {"k": 1})
    assert set(again.sizes) == set(c.sizes) and not list((tmp_path / "c").glob("*.tmp"))
    other = StateCache(tmp_path / "c", 2 * one, {"k": 2})  # other extract settings: emptied
    assert other.bytes == 0 and other.get("a") is None
    fp8 = stored_form(x, x[:, :4], "float8_e4m3fn")
    assert fp8["aux"].dtype == torch.float8_e4m3fn and "aux_scale" in fp8


def test_kill_9_mid_epoch_resumes_to_the_same_weights(offline, gen_dir, smol_model, tmp_path):
    """`eagle3 train` with online states killed with SIGKILL after a mid-epoch checkpoint: the
    rerun resumes there (same data order, the cache's whole files reused) and ends with the
    uninterrupted run's weights."""
    from eagle3.extract.runner import extract
    from eagle3.train import train

    sets = [*BASE, *ONLINE, "train.checkpoint_every_steps=1"]
    cfg = gen_cfg(tmp_path, *sets)
    ext = tmp_path / "extract"
    extract(cfg, gen_dir, ext, str(smol_model))
    vocab = offline / "vocab" / "vocab.safetensors"
    straight = train(cfg, ext, vocab, smol_model, tmp_path / "straight")
    total = straight["steps"]

    out = tmp_path / "killed"
    argv = [sys.executable, "-m", "eagle3.cli", "train", "-c", str(CPU_PROFILE)]
    for s in [f"paths.runs_dir={tmp_path}", "generate.max_tokens=24", *sets]:
        argv += ["--set", s]
    argv += ["--extract-dir", str(ext), "--vocab-file", str(vocab), "--out", str(out)]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    state = out / "checkpoints" / "latest" / "state.json"
    killed_at = None
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        if state.is_file():
            try:
                st = json.loads(state.read_text())["state"]
            except (OSError, ValueError, KeyError):
                st = None
            if st and st["epoch"] >= 1 and st["batch_in_epoch"] > 0:  # mid-epoch 2
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
                killed_at = st["step"]
                break
        time.sleep(0.02)
    assert killed_at is not None, f"never saw a mid-epoch checkpoint: {proc.stderr.read()[-2000:]}"
    assert 0 < killed_at < total
    rest = train(cfg, ext, vocab, smol_model, out)
    assert rest["complete"] and rest["resumed_from_step"] >= killed_at and rest["steps"] == total
    a = load_file(str(tmp_path / "straight" / "checkpoints" / "latest" / "model.safetensors"))
    b = load_file(str(out / "checkpoints" / "latest" / "model.safetensors"))
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.vllm
def test_online_vllm_matches_offline_vllm(smol_vllm_extract, gen_dir, smol_model, tmp_path):
    """The vLLM source: train starts the extract server (the extract backend's server and
    connector), asks it for each batch ahead of the step, deletes each file it read, and matches
    the offline run of the same server's stored states (the session's vLLM extract,
    ``smol_vllm_extract``: its auxiliary layers unsorted, as the online run's)."""
    from eagle3.extract.runner import extract
    from eagle3.train import train
    from eagle3.vocab import vocab_stage
    from tests.conftest import SMOL_VLLM_AUX

    vllm = ["extract.backend=vllm", f"extract.aux_layers={SMOL_VLLM_AUX}"]
    off_cfg = gen_cfg(tmp_path, *BASE, *vllm)
    require_vllm(off_cfg)
    ext_off = smol_vllm_extract.dir
    vocab_stage(ext_off, tmp_path / "vocab", 49152, 512)
    vocab = tmp_path / "vocab" / "vocab.safetensors"
    train(off_cfg, ext_off, vocab, smol_model, tmp_path / "train-off")

    on_cfg = gen_cfg(tmp_path, *BASE, *ONLINE, *vllm)
    extract(on_cfg, gen_dir, tmp_path / "ext-on", str(smol_model))
    t0 = time.monotonic()
    man = train(on_cfg, tmp_path / "ext-on", vocab, smol_model, tmp_path / "train-on")
    worst = assert_losses_close(tmp_path / "train-off", tmp_path / "train-on", 1e-4)
    st = man["states"]
    print(
        f"\nonline vllm vs offline vllm: worst loss difference {worst:.1e} relative; "
        f"train {time.monotonic() - t0:.0f} s (server start included), {json.dumps(st)}"
    )
    assert st["backend"] == "vllm" and st["produced"] + st["cache_hits"] == 16
    assert st["cache_peak_bytes"] <= st["cache_budget_bytes"]
    hidden = tmp_path / "train-on" / "vllm-work" / "vllm-hidden"
    assert not list(hidden.iterdir()), "per-request files are deleted once read"
    assert math.isfinite(man["final"]["loss"][0])


def test_online_vllm_refuses_several_ranks(tmp_path):
    from eagle3.extract.storage import HiddenStateDataset
    from eagle3.train.online import open_online

    cfg = gen_cfg(tmp_path, *ONLINE, "extract.backend=vllm")
    with pytest.raises(ValueError, match="one training process"):
        open_online(
            cfg,
            HiddenStateDataset.__new__(HiddenStateDataset),
            tmp_path,
            tmp_path,
            torch.device("cpu"),
            torch.float32,
            rank=0,
            world=2,
        )
