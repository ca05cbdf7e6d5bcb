"""Train stage on CPU: a synthetic tiny Llama target folder, a synthetic hidden-state dataset."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3.config import config_from_dict
from eagle3.extract.storage import Sample, ShardWriter
from eagle3.train import (
    TrainingDiverged,
    load_target_head,
    make_batch,
    step_inputs,
    target_distribution,
    train,
    ttt_mask,
)
from eagle3.vocab import build_vocab, count_tokens, save_vocab

H, V, TOKENS, DRAFT_V = 64, 512, 64, 80


def make_target(root: Path, seed: int = 0) -> tuple[Path, torch.Tensor]:
    root.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    embed = torch.randn(V, H, generator=g)
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": H,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 4,
        "intermediate_size": 128,
        "vocab_size": V,
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 256,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
    }
    (root / "config.json").write_text(json.dumps(cfg))
    save_file(
        {"model.embed_tokens.weight": embed, "model.norm.weight": torch.full((H,), 0.15)},
        str(root / "model.safetensors"),
    )
    return root, embed


def g_map(x: torch.Tensor) -> torch.Tensor:
    return (5 * x + 3) % TOKENS


def make_data(
    root: Path,
    embed: torch.Tensor,
    n: int = 32,
    seed: int = 0,
    nan_ids: tuple[int, ...] = (),
    lengths: list[int] | None = None,
) -> Path:
    """final[u] = E[g(x_u)]: the target's next-token distribution is a function of the token at u."""
    g = torch.Generator().manual_seed(seed)
    w = ShardWriter(root, samples_per_shard=8)
    for i in range(n):
        t = lengths[i] if lengths else int(torch.randint(20, 40, (1,), generator=g))
        ids = torch.randint(0, TOKENS, (t,), generator=g)
        mask = torch.ones(t, dtype=torch.bool)
        mask[:4] = False
        aux = torch.randn(t, 3 * H, generator=g)
        if i in nan_ids:
            aux[3] = float("nan")
        w.add(Sample(f"s{i:03d}", ids, mask, aux, embed[g_map(ids)].clone()))
    w.close()
    return root


def make_vocab(extract_dir: Path, path: Path) -> Path:
    from eagle3.extract.storage import iter_token_masks

    counts = count_tokens(
        ((ids.tolist(), m.tolist()) for ids, m in iter_token_masks(extract_dir)), V
    )
    save_vocab(build_vocab(counts, DRAFT_V), path)
    return path


def make_cfg(**train):
    base = dict(
        epochs=2,
        lr=3e-3,
        warmup_ratio=0.1,
        ttt_steps=2,
        token_budget=256,
        max_seq_len=64,
        draft_intermediate_size=128,
        checkpoint_every_steps=1000,
    )
    base.update(train)
    return config_from_dict(
        {
            "name": "t",
            "target": {
                "model": "x",
                "served_model_name": "x",
                "num_hidden_layers": 4,
                "hidden_size": H,
                "vocab_size": V,
            },
            "generate": {"dataset": "x"},
            "extract": {"aux_layers": [1, 2, 3]},
            "vocab": {"draft_vocab_size": DRAFT_V},
            "train": base,
        }
    )


def make_setup(tmp: Path) -> tuple:
    """(folder, target, its embedding, extract, vocab file): the tiny run every test trains on."""
    target, embed = make_target(tmp / "target")
    ext = make_data(tmp / "extract", embed)
    vocab = make_vocab(ext, tmp / "vocab.safetensors")
    return tmp, target, embed, ext, vocab


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return make_setup(tmp_path_factory.mktemp("train"))


def test_setup_vocab_counts_the_extracts_assistant_tokens(setup):
    """The tiny run's vocab (make_vocab: count_tokens over the extract's tokens): each id counted
    once per loss-masked position, read back from the shards here; the 4 prompt positions of
    every sample not counted; every id the data uses has a draft row."""
    _, _, _, ext, vocab = setup
    from eagle3.extract.storage import HiddenStateDataset
    from eagle3.vocab import load_vocab

    m = load_vocab(vocab)
    ds = HiddenStateDataset(ext)
    want = torch.zeros(V, dtype=torch.int64)
    for i in range(len(ds)):
        s = ds[i]
        mask = s.loss_mask.bool()
        assert not mask[:4].any() and mask[4:].all()
        want.index_add_(0, s.input_ids[mask], torch.ones(int(mask.sum()), dtype=torch.int64))
    assert len(ds) == 32 and torch.equal(m.counts, want)
    assert int(m.counts.sum()) == sum(ds.length(i) - 4 for i in range(len(ds)))
    assert m.draft_vocab_size == DRAFT_V and bool(m.t2d[:TOKENS].all())


def test_target_distribution_chunked_and_masked(setup):
    _, target, embed, _, vocab = setup
    from eagle3.vocab import load_vocab

    m = load_vocab(vocab)
    head = load_target_head(target, m.draft_ids, 1e-5)
    final = torch.cat(
        [embed[[1, 7, 40]], embed[[300, 500]]]
    )  # last two: argmax outside the draft vocab
    p1, a1 = target_distribution(final, head, chunk=2)
    p2, a2 = target_distribution(final, head, chunk=256)
    torch.testing.assert_close(p1, p2)
    assert torch.equal(a1, a2)
    assert a1[:3].tolist() == [1, 7, 40] and a1[3:].tolist() == [
        -1,
        -1,
    ]  # draft ids 0..63 are the first rows
    torch.testing.assert_close(p1.sum(-1), torch.ones(5))
    x = final.float() * torch.rsqrt(final.pow(2).mean(-1, keepdim=True) + 1e-5) * 0.15
    ref = torch.softmax((x @ embed.T)[:, m.draft_ids], -1)
    torch.testing.assert_close(p1, ref)


def test_shift_alignment_toy(setup):
    """x = [10..15], loss mask 0 on the first two tokens; check every step-0 and step-1 pairing."""
    _, target, embed, _, vocab = setup
    from eagle3.vocab import load_vocab

    m = load_vocab(vocab)
    head = load_target_head(target, m.draft_ids, 1e-5)
    ids = torch.arange(10, 16)
    mask = torch.tensor([0, 0, 0, 1, 1, 1], dtype=torch.bool)
    # target's next token after u: 20+u, except u=3 whose argmax (400) is outside the draft vocab
    final = embed[torch.tensor([20, 21, 22, 400, 24, 25])]
    s = Sample("toy", ids, mask, torch.randn(6, 3 * H), final)
    b = make_batch([s], head, torch.device("cpu"), 64)
    probs, arg = target_distribution(final, head)
    assert arg.tolist() == [20, 21, 22, -1, 24, 25]
    # step 0, position t: input x_{t+1}, target P(f_{t+1}); counted iff t+2 < 6, mask[t+2], arg[t+1] in vocab
    x0, p0, a0, ok0 = step_inputs(b, 0)
    assert x0[0].tolist() == [11, 12, 13, 14, 15, 0]
    torch.testing.assert_close(p0[0, :5], probs[1:6])
    assert a0[0].tolist() == [21, 22, -1, 24, 25, -1]
    assert ok0[0].tolist() == [False, True, False, True, False, False]
    # step 1: one position further: input x_{t+2}, target P(f_{t+2}); t+3 < 6, mask[t+3], arg[t+2] in vocab
    x1, p1, a1, ok1 = step_inputs(b, 1)
    assert x1[0].tolist() == [12, 13, 14, 15, 0, 0]
    torch.testing.assert_close(p1[0, :4], probs[2:6])
    assert a1[0].tolist() == [22, -1, 24, 25, -1, -1]
    assert ok1[0].tolist() == [True, False, True, False, False, False]


def test_ttt_mask():
    m = ttt_mask(3, 2)
    expect = torch.tensor(
        [[1, 0, 0, 1, 0, 0, 1, 0, 0], [1, 1, 0, 0, 1, 0, 0, 1, 0], [1, 1, 1, 0, 0, 1, 0, 0, 1]],
        dtype=torch.bool,
    )
    assert torch.equal(m, expect)


def test_ttt_unroll_matches_per_position_reference(setup):
    """Step i at position t == one query at RoPE position t+i over step-0 keys 0..t, then its own
    chain (steps 1..i-1 at t), computed one token at a time with a plain causal KV prefix."""
    _, target, _, _, vocab = setup
    from eagle3.draft import build_draft
    from eagle3.train import ttt_unroll
    from eagle3.vocab import load_vocab

    m = load_vocab(vocab)
    torch.manual_seed(0)
    model = build_draft(target, DRAFT_V, [1, 2, 3], intermediate_size=128).eval()
    head = load_target_head(target, m.draft_ids, 1e-5)
    g = torch.Generator().manual_seed(1)
    T = 7
    s = Sample(
        "a",
        torch.randint(0, TOKENS, (T,), generator=g),
        torch.ones(T, dtype=torch.bool),
        torch.randn(T, 3 * H, generator=g),
        torch.randn(T, H, generator=g),
    )
    b = make_batch([s], head, torch.device("cpu"), 64)
    with torch.no_grad():
        outs = [(o, lg) for _, o, lg in ttt_unroll(model, b, 3)]
        _, _, kv0 = model(step_inputs(b, 0)[0], b.aux, use_cache=True)
        for t in range(T):
            past = (kv0[0][:, :, : t + 1], kv0[1][:, :, : t + 1])
            hidden = outs[0][0][:, t : t + 1]
            for i in (1, 2):
                ids = step_inputs(b, i)[0][:, t : t + 1]
                o, lg, kv = model(
                    ids, hidden, position_ids=torch.tensor([t + i]), past_kv=past, use_cache=True
                )
                torch.testing.assert_close(o, outs[i][0][:, t : t + 1], atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(lg, outs[i][1][:, t : t + 1], atol=1e-5, rtol=1e-5)
                past = (torch.cat([past[0], kv[0]], 2), torch.cat([past[1], kv[1]], 2))
                hidden = o


def test_loss_decreases_and_top1_rises(setup):
    tmp, target, _, ext, vocab = setup
    cfg = make_cfg(epochs=8, lr=1e-2, ttt_steps=2)
    man = train(cfg, ext, vocab, target, tmp / "run-learn")
    hist = json.loads((tmp / "run-learn" / "metrics.json").read_text())["epochs"]
    assert len(hist) == 8 and man["steps"] >= 30
    first, last = hist[0], hist[-1]
    assert last["loss"][0] < 0.7 * first["loss"][0]
    assert last["loss"][1] < first["loss"][1]
    assert last["top1"][0] > first["top1"][0] + 0.3 and last["top1"][0] > 0.6
    assert (tmp / "run-learn" / "metrics.png").stat().st_size > 0
    assert json.loads((tmp / "run-learn" / "manifest.json").read_text())["complete"] is True


RECIPES = {
    "adamw": {},
    # speculators' recipe: Muon + AdamW (two optimizers, one checkpoint), linear decay, the
    # normed residual (written to the export's config)
    "muon": {"optimizer": "muon", "lr_schedule": "linear", "norm_before_residual": True},
}


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_exact_resume(setup, recipe):
    tmp, target, _, ext, vocab = setup
    cfg = make_cfg(epochs=2, checkpoint_every_steps=2, **RECIPES[recipe])
    a_dir, b_dir = tmp / f"run-a-{recipe}", tmp / f"run-b-{recipe}"
    straight = train(cfg, ext, vocab, target, a_dir)
    total = straight["steps"]
    half = total // 2 + 1  # mid-epoch on purpose
    part = train(cfg, ext, vocab, target, b_dir, max_steps=half)
    assert part["complete"] is False and part["step"] == half
    rest = train(cfg, ext, vocab, target, b_dir)
    assert rest["complete"] and rest["resumed_from_step"] == half and rest["steps"] == total
    a = load_file(str(a_dir / "checkpoints" / "latest" / "model.safetensors"))
    b = load_file(str(b_dir / "checkpoints" / "latest" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=1e-6)
    oa = load_file(str(a_dir / "checkpoints" / "latest" / "optimizer.safetensors"))
    ob = load_file(str(b_dir / "checkpoints" / "latest" / "optimizer.safetensors"))
    assert oa.keys() == ob.keys()
    if recipe == "muon":  # Muon's momentum for the matrices, AdamW's moments for the rest
        assert any(k.endswith("momentum_buffer") for k in oa)
        assert any(k.endswith("exp_avg_sq") for k in oa)
        conf = json.loads((Path(straight["export"]) / "config.json").read_text())
        assert conf["norm_before_residual"] is True
    for k in oa:
        torch.testing.assert_close(oa[k], ob[k], atol=1e-6, rtol=1e-6)
    ma = json.loads((a_dir / "metrics.json").read_text())
    mb = json.loads((b_dir / "metrics.json").read_text())
    for ea, eb in zip(ma["epochs"], mb["epochs"]):
        assert ea["top1"] == eb["top1"]
        assert all(math.isclose(x, y, rel_tol=1e-5) for x, y in zip(ea["loss"], eb["loss"]))


def test_export_loads_back(setup):
    tmp, target, _, ext, vocab = setup
    from eagle3.draft.export import load_exported
    from eagle3.vocab import load_vocab

    out = tmp / "run-export"
    man = train(make_cfg(epochs=1), ext, vocab, target, out)
    model, d2t, t2d = load_exported(man["export"])
    m = load_vocab(vocab)
    assert torch.equal(d2t, m.d2t) and torch.equal(t2d, m.t2d)
    ck = load_file(str(out / "checkpoints" / "latest" / "model.safetensors"))
    sd = model.trainable_state_dict()
    for k, v in ck.items():
        torch.testing.assert_close(sd[k], v.float(), atol=2e-2, rtol=1e-2)
    assert model.config.draft_vocab_size == DRAFT_V and model.config.intermediate_size == 128


def test_nan_guard_skips_and_stops(tmp_path):
    target, embed = make_target(tmp_path / "target")
    lengths = [20 + i for i in range(12)]
    ext = make_data(tmp_path / "extract", embed, n=12, nan_ids=(3,), lengths=lengths)
    vocab = make_vocab(ext, tmp_path / "vocab.safetensors")
    man = train(
        make_cfg(epochs=1, token_budget=40), ext, vocab, target, tmp_path / "run"
    )  # one sample per batch
    assert man["skipped_nan"] == 1 and man["updates"] == man["steps"] - 1
    assert all(
        math.isfinite(x)
        for x in json.loads((tmp_path / "run" / "metrics.json").read_text())["epochs"][0]["loss"]
    )

    ext2 = make_data(
        tmp_path / "extract-nan", embed, n=12, nan_ids=tuple(range(12)), lengths=lengths
    )
    with pytest.raises(TrainingDiverged, match="non-finite steps in a row"):
        train(make_cfg(epochs=1, token_budget=40), ext2, vocab, target, tmp_path / "run-nan")


def test_trained_draft_export(trained_draft):
    """The train stage's own export, trained on real generated data (tests/conftest.py
    ``trained_draft``); tests/test_verify.py serves it in vLLM with speculative decoding."""
    conf = json.loads((trained_draft / "config.json").read_text())
    assert conf["architectures"] == ["LlamaForCausalLMEagle3"]
    assert conf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    assert (trained_draft.parent / "metrics.png").exists()


def test_head_from_target_frozen_and_noise(setup):
    """train.head_init=target starts lm_head as the target's rows of the draft vocab and the final norm
    as the target's; train.freeze_head keeps both there; feature noise still trains (finite loss)."""
    from eagle3.draft.export import load_exported
    from eagle3.vocab import load_vocab

    tmp, target, embed, ext, vocab = setup
    ids = load_vocab(vocab).draft_ids
    man = train(
        make_cfg(epochs=1, head_init="target", freeze_head=True, feature_noise=0.1),
        ext,
        vocab,
        target,
        tmp / "run-head",
    )
    model, _, _ = load_exported(man["export"])
    stored = load_file(str(Path(man["export"]) / "model.safetensors"))["lm_head.weight"]
    assert torch.equal(
        stored.float(), embed[ids].to(stored.dtype).float()
    )  # tied target: its embedding rows
    torch.testing.assert_close(model.norm.weight, torch.full((H,), 0.15), atol=1e-3, rtol=1e-2)
    assert man["skipped_nan"] == 0 and all(math.isfinite(x) for x in man["final"]["loss"])
    moved = train(
        make_cfg(epochs=1, head_init="target"), ext, vocab, target, tmp / "run-head-trained"
    )
    learnt = load_file(str(Path(moved["export"]) / "model.safetensors"))["lm_head.weight"]
    assert not torch.equal(learnt, stored)  # not frozen: it learns from the target's rows
    # speculators' head: the target's lm_head rows, frozen, under a final norm of its own from 1
    own = train(
        make_cfg(epochs=1, head_init="target_lm_head", freeze_head=True),
        ext,
        vocab,
        target,
        tmp / "run-head-own-norm",
    )
    weights = load_file(str(Path(own["export"]) / "model.safetensors"))
    assert torch.equal(weights["lm_head.weight"], stored)
    assert not torch.allclose(weights["norm.weight"].float(), torch.ones(H))  # it trained


def test_device_data_batches_equal_shard_batches(setup):
    """train.data_on_device: the batch gathered from the samples held in (device) memory is the
    batch read per sample from the shards, value for value, padding included. (On the CPU here;
    the GPU path is the same gather on another device: bench/quality.py runs it on the H200.)"""
    from eagle3.extract.storage import HiddenStateDataset
    from eagle3.train.batch import make_batch_fast
    from eagle3.train.device_data import DeviceData, fits, make_batch_device
    from eagle3.vocab import load_vocab

    _, target, _, ext, vocab = setup
    ds = HiddenStateDataset(ext, dtype=torch.float32)
    head = load_target_head(target, load_vocab(vocab).draft_ids, 1e-5)
    data = DeviceData.load(ds, torch.device("cpu"))
    assert not fits(ds, torch.device("cpu"))  # auto: CUDA only
    cpu = torch.device("cpu")
    for positions in ("predicted", "input"):
        for idx, max_len in (([3, 0, 17, 9], 64), ([30, 31], 25), ([5], 64)):
            samples = [ds[i] for i in idx]
            a = make_batch_fast(samples, head, cpu, max_len, positions=positions)
            b = make_batch_device(data, idx, head, max_len, positions=positions)
            c = make_batch(samples, head, cpu, max_len, positions=positions)
            for name in ("input_ids", "aux", "probs", "target_arg", "target_ok"):
                torch.testing.assert_close(getattr(b, name), getattr(a, name), rtol=0, atol=0)
                if name != "probs":  # the eager batch leaves padding rows' distribution at 0
                    torch.testing.assert_close(getattr(c, name), getattr(a, name))
            valid = a.target_arg >= 0
            torch.testing.assert_close(c.probs[valid], a.probs[valid])
            if positions == "input":  # speculators': the input token's mask, one position later
                for j, s in enumerate(samples):
                    n = min(len(s), max_len)
                    assert torch.equal(c.target_ok[j, 1:n], s.loss_mask[1:n].bool())
                    assert not c.target_ok[j, 0] and not c.target_ok[j, n:].any()


def test_shuffled_batching_new_batches_every_epoch():
    from eagle3.batching import shuffled_budget_batches

    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(10, 300, (500,), generator=g).tolist()
    e0 = shuffled_budget_batches(lengths, 1024, seed=0)
    e1 = shuffled_budget_batches(lengths, 1024, seed=1)
    for batches in (e0, e1):
        assert sorted(i for b in batches for i in b) == list(range(500))  # each sample once
        assert all(len(b) * max(lengths[i] for i in b) <= 1024 for b in batches)
        padded = sum(len(b) * max(lengths[i] for i in b) for b in batches)
        assert sum(lengths) / padded > 0.85  # length-bucketed within windows: little padding
    assert {frozenset(b) for b in e0} != {frozenset(b) for b in e1}
    assert shuffled_budget_batches(lengths, 1024, seed=0) == e0  # seeded: resumable


def test_packed_batching_random_documents_up_to_the_budget():
    from eagle3.batching import packed_budget_batches

    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(10, 300, (500,), generator=g).tolist() + [3000]
    e0 = packed_budget_batches(lengths, 1024, seed=0)
    assert sorted(i for b in e0 for i in b) == list(range(501))
    assert all(sum(lengths[i] for i in b) <= 1024 or len(b) == 1 for b in e0)
    full = [sum(lengths[i] for i in b) for b in e0[:-1]]  # rows are filled (a packer's rows)
    assert sum(full) / len(full) > 1024 - 300
    mixed = [max(lengths[i] for i in b) / min(lengths[i] for i in b) for b in e0 if len(b) > 2]
    assert sum(mixed) / len(mixed) > 3  # random lengths together, not length buckets
    assert packed_budget_batches(lengths, 1024, seed=1) != e0


def test_data_on_device_and_shuffled_batching_train_and_resume(setup):
    """Training from the samples held in memory gives the weights that reading the shards gives;
    shuffled batching resumes exactly mid-epoch (its batches are a function of seed and epoch)."""
    tmp, target, _, ext, vocab = setup
    runs = {}
    ways = {"off": "off", "on": "on", "prefetch": "off"}  # prefetch: the loader thread on the CPU
    for name, where in ways.items():
        extra = {"data_on_device": where, "prefetch": "on" if name == "prefetch" else "off"}
        cfg = make_cfg(epochs=2, batching="shuffled", checkpoint_every_steps=2, **extra)
        runs[name] = train(cfg, ext, vocab, target, tmp / f"run-dev-{name}")
    packed = train(make_cfg(epochs=1, batching="packed"), ext, vocab, target, tmp / "run-packed")
    assert packed["complete"] and all(math.isfinite(x) for x in packed["final"]["loss"])
    assert runs["on"]["steps"] == runs["off"]["steps"]
    assert runs["on"]["data_on_device"]["on"] and not runs["off"]["data_on_device"]["on"]
    assert runs["on"]["loop_s"] > 0
    a = load_file(str(tmp / "run-dev-off" / "checkpoints" / "latest" / "model.safetensors"))
    b = load_file(str(tmp / "run-dev-on" / "checkpoints" / "latest" / "model.safetensors"))
    p = load_file(str(tmp / "run-dev-prefetch" / "checkpoints" / "latest" / "model.safetensors"))
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=1e-6)
        assert torch.equal(p[k], a[k])  # the same batches, only built on another thread
    cfg = make_cfg(epochs=2, batching="shuffled", checkpoint_every_steps=2, data_on_device="on")
    half = runs["on"]["steps"] // 2 + 1
    part = train(cfg, ext, vocab, target, tmp / "run-dev-resume", max_steps=half)
    assert part["complete"] is False
    rest = train(cfg, ext, vocab, target, tmp / "run-dev-resume")
    assert rest["resumed_from_step"] == half and rest["steps"] == runs["on"]["steps"]
    c = load_file(str(tmp / "run-dev-resume" / "checkpoints" / "latest" / "model.safetensors"))
    for k in a:
        torch.testing.assert_close(c[k], b[k], atol=1e-6, rtol=1e-6)
