"""The fast step's batches (issue 15): the target's argmax computed once per sample, then only
the draft rows of the target head; the loader thread that pads the next step's batches. Each is
checked against the batch built from scratch (eagle3.train.batch.make_batch_fast), on the CPU."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from eagle3.extract.storage import HiddenStateDataset
from eagle3.train import load_target_head, target_distribution, train
from eagle3.train.batch import make_batch_fast
from eagle3.train.device_data import DeviceData, make_batch_device
from eagle3.train.loader import Loader
from eagle3.train.target import target_argmax
from eagle3.vocab import load_vocab
from tests.test_train import make_cfg, make_setup

CPU = torch.device("cpu")
NAMES = ("input_ids", "aux", "probs", "target_arg", "target_ok")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return make_setup(tmp_path_factory.mktemp("loader"))


@pytest.fixture(scope="module")
def data(setup):
    _, target, _, ext, vocab = setup
    ds = HiddenStateDataset(ext, dtype=torch.float32)
    return ds, load_target_head(target, load_vocab(vocab).draft_ids, 1e-5)


def same_batch(a, b) -> None:
    """Equal batches: the draft-row logits are the same dot products as the full-vocab ones,
    but a GEMM of another width may sum them in another order (float32 rounding)."""
    for name in NAMES:
        x, y = getattr(a, name), getattr(b, name)
        if name == "probs":
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
        else:
            assert torch.equal(x, y), name


def test_argmax_once_then_draft_rows_only(data):
    ds, head = data
    outside = head.lm_head[[300, 500]]  # states whose argmax is outside the draft vocab
    final = torch.cat([ds[i].final for i in range(4)] + [outside])
    probs, arg = target_distribution(final, head, chunk=7)
    assert (arg[:-2] >= 0).all() and (arg[-2:] < 0).all()
    assert torch.equal(target_argmax(final, head, chunk=5), arg.to(torch.int32))
    again, same = target_distribution(final, head, chunk=7, arg=arg)
    assert torch.equal(same, arg)
    torch.testing.assert_close(again, probs, rtol=1e-5, atol=1e-6)
    assert head.draft_rows is not None and head.draft_rows.shape[0] == head.draft_ids.numel()


@pytest.mark.parametrize("prefetch", [False, True])
def test_loader_batches_equal_fresh_batches(data, prefetch):
    """First batch of a sample: the full target head; later ones (other batch mates, another
    length cut): its remembered argmax. Prefetched or not, each equals a batch built afresh."""
    ds, head = data
    loader = Loader(ds.__getitem__, head, CPU, 64, prefetch=prefetch)
    plan = [[3, 0, 17], [9], [0, 3, 17], [17, 9, 3, 0], [30, 31], [31]]
    try:
        for n, idx in enumerate(plan):
            loader.prefetch(plan[n + 1 : n + 2])
            same_batch(loader.batch(idx), make_batch_fast([ds[i] for i in idx], head, CPU, 64))
        loader.max_seq_len = 25  # shorter cuts of remembered samples (bench/train.py varies it)
        same_batch(loader.batch([0, 9]), make_batch_fast([ds[0], ds[9]], head, CPU, 25))
        loader.prefetch([[1, 2]])  # asked for, never taken: dropped at close
    finally:
        loader.close()
    assert set(loader._arg) == {0, 3, 9, 17, 30, 31}


def test_loader_thread_error_surfaces_at_the_batch(data):
    ds, head = data

    def sample(i: int):
        if i == 5:
            raise OSError("shard read failed")
        return ds[i]

    loader = Loader(sample, head, CPU, 64, prefetch=True)
    loader.prefetch([[4, 5]])
    with pytest.raises(OSError, match="shard read failed"):
        loader.batch([4, 5])
    same_batch(loader.batch([4]), make_batch_fast([ds[4]], head, CPU, 64))
    loader.close()


def test_device_data_remembered_argmax_equals_shard_batches(data):
    ds, head = data
    dev = DeviceData.load(ds, CPU)
    dev.remember_argmax(head)
    for idx, max_len in (([3, 0, 17, 9], 64), ([30, 31], 25)):
        fresh = make_batch_fast([ds[i] for i in idx], head, CPU, max_len)
        same_batch(make_batch_device(dev, idx, head, max_len), fresh)


def test_compiled_step_trains_as_the_uncompiled_one(setup, tmp_path):
    """``train.compile: on`` (auto turns it on with CUDA only): inductor's kernels give the weights
    of the uncompiled step to float32 rounding, and the run says it compiled."""
    _, target, _, ext, vocab = setup
    runs = {
        c: train(make_cfg(epochs=1, compile=c), ext, vocab, target, tmp_path / c)
        for c in ("off", "on")
    }
    assert runs["on"]["compiled"] and not runs["off"]["compiled"]
    assert runs["on"]["steps"] == runs["off"]["steps"] > 2
    w = {
        c: load_file(str(tmp_path / c / "checkpoints" / "latest" / "model.safetensors"))
        for c in runs
    }
    for k in w["off"]:
        torch.testing.assert_close(w["on"][k], w["off"][k], rtol=1e-4, atol=1e-5)
