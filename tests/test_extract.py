"""Extract stage: sequences and masks, the HF backend against transformers, storage, resume, errors."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from eagle3.extract.inputs import build_example, iter_examples
from eagle3.extract.runner import TokenizerMismatch, extract
from eagle3.extract.storage import (
    HiddenStateDataset,
    Sample,
    ShardWriter,
    dequantize_fp8,
    quantize_fp8,
)
from eagle3.generate.storage import iter_samples
from tests.conftest import gen_cfg


def test_mask_covers_exactly_the_assistant_tokens(gen_dir, smol_model):
    tok = AutoTokenizer.from_pretrained(smol_model)
    for s in iter_samples(gen_dir):
        ex = build_example(s)
        n_prompt = len(s["prompt_token_ids"])
        assert ex.loss_mask == [0] * n_prompt + [1] * len(s["completion_token_ids"])
        prompt_text = tok.decode(ex.input_ids[:n_prompt])
        assert prompt_text.endswith("<|im_start|>assistant\n") and "<|im_start|>user" in prompt_text
        masked = tok.decode([t for t, m in zip(ex.input_ids, ex.loss_mask) if m])
        assert masked.startswith(s["content"][:10]) and "<|im_start|>" not in masked
        if s["finish_reason"] == "stop":
            assert masked.endswith("<|im_end|>")  # the end-of-turn token carries loss


def test_mask_with_think_tokens():
    """A template that opens <think>: reasoning, </think>, answer and end token carry loss; <think> does not."""
    sample = {
        "id": "x",
        "prompt_token_ids": [1, 520, 9531, 198, 15, 198],
        "completion_token_ids": [44, 45, 16, 46, 2],
    }
    ex = build_example(sample)
    assert ex.input_ids == [1, 520, 9531, 198, 15, 198, 44, 45, 16, 46, 2]
    assert ex.loss_mask == [0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1]


def test_truncation_policy(gen_dir):
    cut = [
        x
        for x in iter_examples(gen_dir, max_seq_len=40, truncation="truncate")
        if not isinstance(x, tuple)
    ]
    assert cut and all(len(x.input_ids) <= 40 for x in cut) and any(x.truncated_from for x in cut)
    skipped = [
        x for x in iter_examples(gen_dir, max_seq_len=40, truncation="skip") if isinstance(x, tuple)
    ]
    assert skipped and all("> max_seq_len 40" in reason for _, reason in skipped)


def test_hf_backend_matches_transformers(gen_dir, smol_model, tmp_path):
    cfg = gen_cfg(tmp_path, "extract.token_budget=256")
    m = extract(cfg, gen_dir, tmp_path / "extract", str(smol_model))
    assert m["samples"] == 8 and m["aux_layers"] == [2, 15, 27] and m["tokenizer_fingerprint"]
    assert m["bytes_per_token"] == pytest.approx(
        2 * (3 * 576 + 576) + 9, abs=2
    )  # bf16 states + ids/mask
    ds = HiddenStateDataset(tmp_path / "extract", dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(smol_model, dtype=torch.float32).eval()
    worst = 0.0
    for i in range(len(ds)):
        s = ds[i]
        with torch.inference_mode():
            hs = ref(s.input_ids[None], output_hidden_states=True).hidden_states
        want_aux = torch.cat([hs[k][0] for k in (2, 15, 27)], dim=-1)
        # HF's last hidden state is after the final norm; ours is before it
        want_final_normed = hs[-1][0]
        got_final_normed = ref.model.norm(s.final)
        for got, want in ((s.aux, want_aux), (got_final_normed, want_final_normed)):
            rel = ((got - want).norm() / want.norm()).item()
            worst = max(worst, rel)
    assert worst < 8e-3, f"relative error {worst:.2e} (bf16 storage rounds at ~4e-3)"


def test_fp8_storage_is_half_the_bytes_and_close(tmp_path):
    torch.manual_seed(0)
    x = torch.randn(100, 64) * torch.logspace(-2, 2, 100)[:, None]  # rows of very different scales
    q, scale = quantize_fp8(x)
    rel = ((dequantize_fp8(q, scale, torch.float32) - x).norm(dim=-1) / x.norm(dim=-1)).max().item()
    assert q.dtype == torch.float8_e4m3fn and rel < 0.05
    sizes = {}
    for dtype in ("bfloat16", "float8_e4m3fn"):
        w = ShardWriter(tmp_path / dtype, dtype, samples_per_shard=4)
        for i in range(4):
            w.add(
                Sample(
                    f"s{i}",
                    torch.arange(50),
                    torch.ones(50, dtype=torch.bool),
                    torch.randn(50, 96),
                    torch.randn(50, 32),
                )
            )
        w.close()
        sizes[dtype] = w.bytes_written
        back = HiddenStateDataset(tmp_path / dtype)[2]
        assert back.id == "s2" and back.aux.shape == (50, 96) and back.final.dtype == torch.bfloat16
    assert sizes["float8_e4m3fn"] < 0.6 * sizes["bfloat16"]


def test_nan_samples_skipped_and_resume_by_id(gen_dir, smol_model, tmp_path, monkeypatch):
    import eagle3.extract.hf_backend as hf

    real = hf.forward_states
    poisoned = {}

    def poison(model, tap, seqs, device, pad_id=0):
        outs = real(model, tap, seqs, device, pad_id)
        if not poisoned:
            aux, final = outs[0]
            final = final.clone()
            final[0, 0] = float("nan")
            outs[0] = (aux, final)
            poisoned["seq"] = seqs[0]
        return outs

    monkeypatch.setattr(hf, "forward_states", poison)
    cfg = gen_cfg(tmp_path, "extract.samples_per_shard=3", "extract.chunk_samples=4")
    out = tmp_path / "extract"
    m = extract(cfg, gen_dir, out, str(smol_model))
    errors = [json.loads(x) for x in (out / "errors.jsonl").read_text().splitlines()]
    assert m["samples"] == 7 and m["this_run"]["nonfinite"] == 1
    assert [e["reason"] for e in errors] == ["non-finite hidden states (NaN/inf)"]
    # resume: a rerun stores only what is missing (the poisoned sample, now clean)
    monkeypatch.setattr(hf, "forward_states", real)
    (out / ".hidden-00009.safetensors.tmp").write_bytes(b"half a shard")  # left by a killed run
    m2 = extract(cfg, gen_dir, out, str(smol_model))
    assert (
        m2["samples"] == 8 and m2["this_run"]["resumed_from"] == 7 and m2["this_run"]["stored"] == 1
    )
    assert not list(out.glob(".*.tmp"))
    ds = HiddenStateDataset(out)
    assert len(set(ds.ids)) == 8


def test_reader_batches_respect_the_budget(gen_dir, smol_model, tmp_path):
    cfg = gen_cfg(tmp_path)
    extract(cfg, gen_dir, tmp_path / "extract", str(smol_model))
    ds = HiddenStateDataset(tmp_path / "extract")
    batches = list(ds.batches(token_budget=200, seed=1))
    assert sorted(i for b in batches for i in b) == list(range(len(ds)))
    for b in batches:
        assert len(b) == 1 or len(b) * max(ds.length(i) for i in b) <= 200
    # the seed shuffles the batches (a different order for another seed, the same for the same)
    assert len(batches) >= 3 and batches == list(ds.batches(token_budget=200, seed=1))
    assert batches != list(ds.batches(token_budget=200, seed=2))


def test_tokenizer_mismatch_is_a_clear_error(gen_dir, smol_model, tmp_path):
    fake = tmp_path / "gen"
    fake.mkdir()
    for f in gen_dir.iterdir():
        (fake / f.name).write_bytes(f.read_bytes())
    manifest = json.loads((fake / "manifest.json").read_text())
    manifest["tokenizer_fingerprint"] = "0123456789abcdef"
    (fake / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(TokenizerMismatch, match="differs from 0123456789abcdef"):
        extract(gen_cfg(tmp_path), fake, tmp_path / "extract", str(smol_model))


def test_generate_fingerprint_matches_local_tokenizer(gen_dir, smol_model):
    from eagle3.fingerprint import local_fingerprint

    recorded = json.loads((gen_dir / "manifest.json").read_text())["tokenizer_fingerprint"]
    assert recorded == local_fingerprint(AutoTokenizer.from_pretrained(smol_model))


def test_vocab_stage_counts_loss_tokens(gen_dir, smol_model, tmp_path):
    from collections import Counter

    from eagle3.vocab import draft_to_target, load_vocab, vocab_stage

    cfg = gen_cfg(tmp_path)
    extract(cfg, gen_dir, tmp_path / "extract", str(smol_model))
    m = vocab_stage(tmp_path / "extract", tmp_path / "vocab", 49152, 64)
    counts = Counter(t for s in iter_samples(gen_dir) for t in s["completion_token_ids"])
    assert m["loss_tokens"] == sum(counts.values()) and m["distinct"] == len(counts)
    v = load_vocab(tmp_path / "vocab" / "vocab.safetensors")
    top = {t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:64]}
    assert set(draft_to_target(v.d2t).tolist()) == top
    assert (tmp_path / "vocab" / "coverage.png").stat().st_size > 1000


def test_hf_backend_on_a_tiny_deepseek_v3(gen_dir, smol_model, tmp_path):
    """The Kimi architecture family (MLA + MoE) through the HF backend: a tiny random DeepseekV3."""
    from eagle3.config import ConfigError
    from eagle3.tiny import make_tiny_deepseek_v3

    tiny = make_tiny_deepseek_v3(tmp_path / "tiny-dsv3", tokenizer_from=smol_model)
    target = [
        f"target.model={tiny}",
        "target.num_hidden_layers=6",
        "target.hidden_size=256",
        "target.architecture=deepseek_v3",
    ]
    with pytest.raises(ConfigError, match=r"extract.aux_layers \[2, 3, 3\] must be distinct"):
        gen_cfg(tmp_path, *target)  # the default (2, N//2, N-3) collides on 6 layers
    cfg = gen_cfg(tmp_path, *target, "extract.aux_layers=[1, 3, 4]")
    m = extract(cfg, gen_dir, tmp_path / "extract", str(tiny))
    assert m["samples"] == 8 and m["bytes_per_token"] == pytest.approx(2 * 4 * 256 + 9, abs=2)
    ds = HiddenStateDataset(tmp_path / "extract", dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    s = ds[0]
    with torch.inference_mode():
        hs = ref(s.input_ids[None], output_hidden_states=True).hidden_states
    want = torch.cat([hs[k][0] for k in (1, 3, 4)], dim=-1)
    assert ((s.aux - want).norm() / want.norm()).item() < 8e-3
    assert ((ref.model.norm(s.final) - hs[-1][0]).norm() / hs[-1][0].norm()).item() < 8e-3


def _first_samples(gen_dir, out, n):
    """A copy of a generate output with its first ``n`` samples (yesterday's data, for the nightly)."""
    out.mkdir(parents=True)
    lines = (gen_dir / "samples-00000.jsonl").read_text().splitlines()[:n]
    (out / "samples-00000.jsonl").write_text("\n".join(lines) + "\n")
    m = json.loads((gen_dir / "manifest.json").read_text())
    m["totals"]["samples"] = n
    (out / "manifest.json").write_text(json.dumps(m))
    return out


def test_extract_reuses_what_a_previous_extract_with_the_same_settings_stored(
    gen_dir, smol_model, tmp_path, monkeypatch
):
    """The nightly case: 5 samples extracted yesterday, 8 today: 5 copied, 3 computed; the copies
    are the stored states bit for bit. Other settings, or other tokens for an id: nothing copied."""
    from eagle3.extract.runner import settings_key

    cfg = gen_cfg(tmp_path)
    old = extract(
        cfg, _first_samples(gen_dir, tmp_path / "gen5", 5), tmp_path / "old", str(smol_model)
    )
    assert old["this_run"]["stored"] == 5 and old["settings_key"] == settings_key(cfg)
    new = extract(cfg, gen_dir, tmp_path / "new", str(smol_model), reuse_from=tmp_path / "old")
    assert (new["samples"], new["this_run"]["reused"], new["this_run"]["stored"]) == (8, 5, 3)
    a, b = HiddenStateDataset(tmp_path / "old"), HiddenStateDataset(tmp_path / "new")
    by_id = {b[i].id: b[i] for i in range(len(b))}
    for i in range(len(a)):
        x, y = a[i], by_id[a[i].id]
        assert (
            torch.equal(x.input_ids, y.input_ids)
            and torch.equal(x.aux, y.aux)
            and torch.equal(x.final, y.final)
        )

    other = gen_cfg(
        tmp_path, "extract.max_seq_len=64"
    )  # other settings: the old states do not apply
    m = extract(other, gen_dir, tmp_path / "other", str(smol_model), reuse_from=tmp_path / "old")
    assert m["this_run"]["reused"] == 0 and "other settings" in m["this_run"]["reuse"]["why_not"]
    # same id, other tokens (the prompt was answered again differently): computed, not copied
    changed = _first_samples(gen_dir, tmp_path / "gen2", 2)
    rows = [json.loads(x) for x in (changed / "samples-00000.jsonl").read_text().splitlines()]
    rows[0]["completion_token_ids"] = rows[0]["completion_token_ids"][:-1] + [30]
    (changed / "samples-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    m = extract(cfg, changed, tmp_path / "changed", str(smol_model), reuse_from=tmp_path / "old")
    assert (m["this_run"]["reused"], m["this_run"]["stored"]) == (1, 1)

    # nothing new since yesterday: every sample copied and the backend never started (with the vLLM
    # backend that is a server start, and the GPUs of a running unit, saved)
    def no_backend(*args, **kwargs):
        raise AssertionError("the backend started with nothing to compute")

    monkeypatch.setattr("eagle3.extract.hf_backend.extract_hf", no_backend)
    m = extract(
        cfg, tmp_path / "gen5", tmp_path / "same", str(smol_model), reuse_from=tmp_path / "old"
    )
    assert (m["samples"], m["this_run"]["reused"], m["this_run"]["stored"]) == (5, 5, 0)
