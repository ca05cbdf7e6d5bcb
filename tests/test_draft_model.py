"""The EAGLE-3 drafts (eagle3.draft: the Llama draft, and the tests both drafts share) and the vLLM
exports (eagle3.draft.export). MLA-only tests: tests/test_mla_draft.py.

The vllm-marked test serves a RANDOM-weight draft for SmolLM2 (speculators format) with the real
vLLM CPU server and checks that speculative decoding actually ran (spec-decode counters on /metrics).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3.draft import DraftConfig, Eagle3Draft, Eagle3MLADraft, build_draft
from eagle3.draft.export import (
    MLA_ARCHITECTURE,
    VLLM_WEIGHT_NAMES,
    expected_shapes,
    export_speculators,
    export_vllm,
    load_exported,
    vllm_config_dict,
)
from eagle3.draft.llama import rope_inv_freq
from eagle3.target_checkpoint import load_target_embeddings, load_target_tensor
from eagle3.vocab import build_vocab, draft_to_target
from tests.conftest import spec_counters
from tests.test_mla_draft import KIMI_YARN
from tests.test_mla_draft import tiny_cfg as tiny_mla_cfg

AUX = [2, 15, 27]


def tiny_cfg(**kw) -> DraftConfig:
    base = dict(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=100,
        draft_vocab_size=40,
        target_hidden_size=24,
        aux_layer_ids=[1, 2, 3],
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=128,
    )
    base.update(kw)
    return DraftConfig(**base)


def tiny_vocab(cfg: DraftConfig, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 50, (cfg.vocab_size,), generator=g)
    return build_vocab(counts, cfg.draft_vocab_size)


# ------------------------------------------------------------------------------------------------
# (a) shapes, forward/backward, masks and KV prefixes
# ------------------------------------------------------------------------------------------------


def test_config_from_smollm2(smol_model):
    cfg = DraftConfig.from_target(smol_model, 4096, AUX)
    assert (
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        cfg.vocab_size,
        cfg.target_hidden_size,
    ) == (576, 1536, 9, 3, 64, 49152, 576)
    assert cfg.rope_theta == 100000.0 and cfg.rope_scaling is None and cfg.fc_input_size == 3 * 576
    assert cfg.tie_word_embeddings and cfg.max_position_embeddings == 8192
    assert (
        DraftConfig.from_target(smol_model, 4096, AUX, intermediate_size=512).intermediate_size
        == 512
    )
    with pytest.raises(ValueError, match="distinct"):
        DraftConfig.from_target(smol_model, 4096, [2, 3, 3])
    with pytest.raises(TypeError, match="unknown"):
        DraftConfig.from_target(smol_model, 4096, AUX, bogus=1)


def test_config_from_nested_and_legacy_rope():
    """Kimi-style text_config wrapper; transformers 4.x rope_theta + rope_scaling spelling."""
    target = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "tie_word_embeddings": False,
        "text_config": {
            "hidden_size": 7168,
            "intermediate_size": 18432,
            "num_attention_heads": 64,
            "num_key_value_heads": 64,
            "vocab_size": 163840,
            "rms_norm_eps": 1e-6,
            "rope_theta": 50000.0,
            "max_position_embeddings": 262144,
            "rope_scaling": {
                "type": "yarn",
                "factor": 64.0,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "original_max_position_embeddings": 4096,
            },
        },
    }
    cfg = DraftConfig.from_target(target, 32000, [2, 30, 58], num_key_value_heads=8)
    assert cfg.head_dim == 112 and cfg.num_key_value_heads == 8 and cfg.vocab_size == 163840
    assert cfg.rope_type == "yarn" and cfg.rope_theta == 50000.0 and "type" not in cfg.rope_scaling
    inv, mscale = rope_inv_freq(cfg)
    assert inv.shape == (56,) and mscale == pytest.approx(1.0)  # mscale / mscale_all_dim cancel


#: The drafts the shared tests run on: (module class, config). The MLA ones carry Kimi-K2.5's YaRN
#: RoPE (original 16 positions, so it bites at these lengths), with and without q_lora_rank.
DRAFTS = {
    "llama": lambda: (Eagle3Draft, tiny_cfg()),
    "llama-3-layers": lambda: (Eagle3Draft, tiny_cfg(num_layers=3)),
    "mla": lambda: (
        Eagle3MLADraft,
        tiny_mla_cfg(rope_scaling=dict(KIMI_YARN, original_max_position_embeddings=16)),
    ),
    "mla-no-q-lora": lambda: (
        Eagle3MLADraft,
        tiny_mla_cfg(
            q_lora_rank=None, rope_scaling=dict(KIMI_YARN, original_max_position_embeddings=16)
        ),
    ),
}


@pytest.mark.parametrize("arch", list(DRAFTS))
def test_shapes_forward_backward(arch):
    torch.manual_seed(0)
    cls, cfg = DRAFTS[arch]()
    m = cls(cfg)
    shapes = expected_shapes(cfg)
    got = {k: tuple(v.shape) for k, v in m.trainable_state_dict().items()}
    assert got == {k: v for k, v in shapes.items() if k not in ("d2t", "t2d")}
    if arch.startswith("mla"):
        assert ("midlayer.self_attn.q_proj.weight" in got) == (cfg.q_lora_rank is None)
    assert (
        tuple(m.embed_tokens.weight.shape) == (100, 32) and not m.embed_tokens.weight.requires_grad
    )

    b, t = 2, 9
    ids = torch.randint(0, cfg.vocab_size, (b, t))
    aux = torch.randn(b, t, cfg.fc_input_size)
    out, logits = m(ids, aux)
    assert out.shape == (b, t, 32) and logits.shape == (b, t, 40)
    # a second, unrolled step on the returned H-wide state (no fc)
    out2, logits2 = m(ids.roll(-1, 1), out)
    loss = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), torch.randint(0, 40, (b * t,))
    ) + torch.nn.functional.cross_entropy(logits2.flatten(0, 1), torch.randint(0, 40, (b * t,)))
    loss.backward()
    assert m.embed_tokens.weight.grad is None
    for name, p in m.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, (
                name
            )
    with pytest.raises(ValueError, match="last dim"):
        m(ids, torch.randn(b, t, 7))


#: Per draft: the cached (k, v) shapes of 3 positions of a batch of 2. Llama: [B, kv_heads, S, head_dim];
#: MLA: the expanded per-head keys (nope + rope dims) and values.
KV_SHAPES = {"llama": ((2, 2, 3, 8), (2, 2, 3, 8)), "mla": ((2, 4, 3, 16), (2, 4, 3, 6))}


@pytest.mark.parametrize("arch", ["llama", "mla", "llama-3-layers"])
def test_causal_and_masks_and_kv_prefix(arch):
    """With several layers the prefix is a LayerCaches, one (k, v) per layer, each layer's keys
    of the earlier positions: the halves, the token-at-a-time and the TTT step hold as with one."""
    from eagle3.draft.common import LayerCaches, per_layer

    torch.manual_seed(1)
    cls, cfg = {
        "llama": (Eagle3Draft, tiny_cfg()),
        "mla": (Eagle3MLADraft, tiny_mla_cfg()),
        "llama-3-layers": (Eagle3Draft, tiny_cfg(num_layers=3)),
    }[arch]
    m = cls(cfg).eval()
    b, t = 2, 8
    ids = torch.randint(0, cfg.vocab_size, (b, t))
    aux = torch.randn(b, t, cfg.fc_input_size)
    with torch.no_grad():
        out, _ = m(ids, aux)
        # causal: changing a later position does not change earlier outputs
        aux2 = aux.clone()
        aux2[:, 5:] += 1.0
        out2, _ = m(ids, aux2)
        assert torch.allclose(out[:, :5], out2[:, :5], atol=1e-6) and not torch.allclose(
            out[:, 5:], out2[:, 5:]
        )
        # explicit boolean and additive masks equal to the causal default
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        assert torch.allclose(m(ids, aux, attn_mask=causal)[0], out, atol=1e-5)
        additive = torch.zeros(t, t).masked_fill(~causal, float("-inf"))
        assert torch.allclose(m(ids, aux, attn_mask=additive)[0], out, atol=1e-5)
        # KV prefix: two halves with the cache == one pass (positions continue after the prefix)
        o1, _, kv = m(ids[:, :3], aux[:, :3], use_cache=True)
        o2, _ = m(ids[:, 3:], aux[:, 3:], past_kv=kv)
        assert torch.allclose(torch.cat([o1, o2], 1), out, atol=1e-5)
        layers = kv if isinstance(kv, LayerCaches) else [kv]
        assert len(layers) == getattr(cfg, "num_layers", 1)
        for k, v in layers:
            assert (k.shape, v.shape) == KV_SHAPES[arch.split("-")[0]]
        # one token at a time == one pass
        past, outs = None, []
        for i in range(t):
            o, _, kv_i = m(ids[:, i : i + 1], aux[:, i : i + 1], past_kv=past, use_cache=True)
            past = (
                kv_i
                if past is None
                else per_layer(
                    lambda p, n: (torch.cat([p[0], n[0]], 2), torch.cat([p[1], n[1]], 2)),
                    past,
                    kv_i,
                )
            )
            outs.append(o)
        assert torch.allclose(torch.cat(outs, 1), out, atol=1e-5)
        # TTT-shaped step: prefix = step 0's keys, mask causal over it + diagonal over the new block
        _, _, kv0 = m(ids, aux, use_cache=True)
        ttt_mask = torch.cat([causal, torch.eye(t, dtype=torch.bool)], dim=1)
        o_ttt, l_ttt = m(
            ids.roll(-1, 1), out, past_kv=kv0, attn_mask=ttt_mask, position_ids=torch.arange(t)
        )
        assert o_ttt.shape == (b, t, 32) and l_ttt.shape == (b, t, 40)
        with pytest.raises(ValueError, match="attn_mask"):
            m(ids, out, past_kv=kv0, attn_mask=causal)


def test_attention_matches_transformers_llama():
    """Our attention (RoPE, GQA, causal SDPA) against transformers' LlamaAttention with 2H q/k/v inputs."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

    torch.manual_seed(2)
    cfg = tiny_cfg(rope_theta=100000.0)
    m = Eagle3Draft(cfg).eval()
    hf_cfg = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        max_position_embeddings=128,
        attention_bias=False,
    )
    hf_cfg._attn_implementation = "sdpa"
    attn = LlamaAttention(hf_cfg, layer_idx=0).eval()
    for name in ("q_proj", "k_proj", "v_proj"):
        lin = getattr(m.midlayer.self_attn, name)
        setattr(attn, name, torch.nn.Linear(64, lin.out_features, bias=False))
        getattr(attn, name).weight.data.copy_(lin.weight.data)
    attn.o_proj.weight.data.copy_(m.midlayer.self_attn.o_proj.weight.data)
    x = torch.randn(2, 6, 64)
    pos = torch.arange(3, 9).unsqueeze(0).expand(2, 6)
    with torch.no_grad():
        cos, sin = m.rotary(pos, x.dtype)
        ours, _ = m.midlayer.self_attn(x, cos, sin, None, None)
        hf_cos, hf_sin = LlamaRotaryEmbedding(hf_cfg)(x, pos)
        theirs = attn(x, (hf_cos, hf_sin), attention_mask=None)[0]
    assert torch.allclose(ours, theirs, atol=1e-5), (ours - theirs).abs().max()


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_type": "linear", "factor": 4.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096},
    ],
)
def test_rope_scaling_matches_transformers(scaling):
    """Inverse frequencies of the scaled RoPE variants against transformers' implementations
    (vLLM's formulas were copied; transformers is an independent check)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = tiny_cfg(
        head_dim=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        hidden_size=128,
        rope_theta=500000.0,
        rope_scaling=dict(scaling),
        max_position_embeddings=32768,
    )
    hf = LlamaRotaryEmbedding(
        LlamaConfig(
            hidden_size=128,
            num_attention_heads=2,
            head_dim=64,
            max_position_embeddings=32768,
            rope_parameters={**scaling, "rope_theta": 500000.0},
        )
    )
    inv, mscale = rope_inv_freq(cfg)
    assert torch.allclose(inv, hf.inv_freq.float(), rtol=1e-5)
    assert mscale == pytest.approx(float(getattr(hf, "attention_scaling", 1.0)), rel=1e-6)


# ------------------------------------------------------------------------------------------------
# (b) reading single tensors from the target's checkpoint
# ------------------------------------------------------------------------------------------------


def test_load_target_tensor_smollm2(smol_model):
    embed = load_target_tensor(smol_model, "model.embed_tokens.weight")
    assert embed.shape == (49152, 576) and embed.dtype == torch.bfloat16
    e2, head = load_target_embeddings(smol_model)  # tied: the lm_head is the embedding
    assert head is e2 and torch.equal(e2, embed)
    with pytest.raises(KeyError, match="none of"):
        load_target_tensor(smol_model, ["lm_head.weight", "nope"])
    m = build_draft(smol_model, 4096, AUX)
    assert torch.equal(m.embed_tokens.weight, embed.float())


def test_load_target_tensor_sharded_opens_only_its_shard(tmp_path, monkeypatch):
    import safetensors

    embed = torch.randn(50, 8)
    head = torch.randn(50, 8)
    save_file(
        {"model.layers.0.w": torch.randn(4, 4), "model.embed_tokens.weight": embed},
        str(tmp_path / "model-00001-of-00002.safetensors"),
    )
    save_file(
        {"model.layers.1.w": torch.randn(4, 4), "lm_head.weight": head},
        str(tmp_path / "model-00002-of-00002.safetensors"),
    )
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps(
            {
                "metadata": {},
                "weight_map": {
                    "model.layers.0.w": "model-00001-of-00002.safetensors",
                    "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                    "model.layers.1.w": "model-00002-of-00002.safetensors",
                    "lm_head.weight": "model-00002-of-00002.safetensors",
                },
            }
        )
    )
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": False}))
    opened: list[str] = []
    real = safetensors.safe_open

    def spy(path, *a, **kw):
        opened.append(Path(path).name)
        return real(path, *a, **kw)

    monkeypatch.setattr(safetensors, "safe_open", spy)
    assert torch.equal(load_target_tensor(tmp_path, "lm_head.weight"), head)
    assert opened == ["model-00002-of-00002.safetensors"]
    opened.clear()
    # candidate names: the first present wins (Kimi-style prefix absent here)
    got = load_target_tensor(
        tmp_path, ["language_model.model.embed_tokens.weight", "model.embed_tokens.weight"]
    )
    assert torch.equal(got, embed) and opened == ["model-00001-of-00002.safetensors"]
    opened.clear()
    e, h = load_target_embeddings(tmp_path)
    assert torch.equal(e, embed) and torch.equal(h, head)
    assert sorted(opened) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]


# ------------------------------------------------------------------------------------------------
# (c) export and load back
# ------------------------------------------------------------------------------------------------

#: What vLLM 0.32's llama_eagle3.py allocates, re-derived by hand from that file for the tiny
#: config (H=32, heads 4 x 8, kv 2 x 8, I=64, 3 aux x Ht=24, D=40, V=100): the loader maps
#: midlayer.* -> model.layers.0.*, stacks q/k/v into qkv_proj (input 2H) and gate/up into
#: gate_up_proj, prefixes "model." on all but lm_head, renames d2t, skips t2d.
VLLM_TINY = {
    "fc.weight": (32, 72),  # ReplicatedLinear(target_hidden * num_aux, hidden)
    "midlayer.input_layernorm.weight": (32,),
    "midlayer.hidden_norm.weight": (32,),
    "midlayer.self_attn.q_proj.weight": (
        32,
        64,
    ),  # QKVParallelLinear(2 * hidden, head_dim, heads, kv)
    "midlayer.self_attn.k_proj.weight": (16, 64),
    "midlayer.self_attn.v_proj.weight": (16, 64),
    "midlayer.self_attn.o_proj.weight": (32, 32),
    "midlayer.post_attention_layernorm.weight": (32,),
    "midlayer.mlp.gate_proj.weight": (64, 32),
    "midlayer.mlp.up_proj.weight": (64, 32),
    "midlayer.mlp.down_proj.weight": (32, 64),
    "norm.weight": (32,),
    "lm_head.weight": (40, 32),  # ParallelLMHead(draft_vocab_size, hidden)
    "d2t": (40,),  # draft_id_to_target_id, torch.long
    "t2d": (100,),  # skipped by the loader
}


def _tiny_export(arch: str, tmp_path: Path):
    """A random tiny draft of ``arch`` exported in the vLLM format: (model, config, vocab, export folder)."""
    if arch == "llama":
        torch.manual_seed(3)
        cls, cfg = Eagle3Draft, tiny_cfg()
    else:
        torch.manual_seed(4)
        cls, cfg = Eagle3MLADraft, tiny_mla_cfg(rope_scaling=dict(KIMI_YARN))
    m = cls(cfg)
    vocab = tiny_vocab(cfg)
    return m, cfg, vocab, export_vllm(m, cfg, vocab.d2t, vocab.t2d, tmp_path / "draft")


@pytest.mark.parametrize("arch", ["llama", "mla"])
def test_export_vllm_roundtrip(arch, tmp_path):
    m, cfg, vocab, out = _tiny_export(arch, tmp_path)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], (
        "temporary folder left behind"
    )
    conf = json.loads((out / "config.json").read_text())
    assert conf == vllm_config_dict(cfg)
    assert (
        conf["architectures"]
        == {"llama": ["LlamaForCausalLMEagle3"], "mla": [MLA_ARCHITECTURE]}[arch]
    )
    assert conf["num_hidden_layers"] == 1
    assert (
        conf["vocab_size"] == 100
        and conf["draft_vocab_size"] == 40
        and conf["target_hidden_size"] == 24
    )
    assert conf["eagle_config"] == {
        "eagle_aux_hidden_state_layer_ids": [1, 2, 3],
        "use_aux_hidden_state": True,
    }
    assert conf["torch_dtype"] == "bfloat16" and conf["norm_before_residual"] is False
    assert conf["rope_parameters"]["rope_theta"] == 10000.0

    tensors = load_file(str(out / "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in tensors.items()} == expected_shapes(cfg)
    assert not any("embed_tokens" in k for k in tensors)  # vLLM shares the target's
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert all(v.dtype == torch.bfloat16 for k, v in tensors.items() if k not in ("d2t", "t2d"))
    assert torch.equal(tensors["d2t"], vocab.d2t) and torch.equal(tensors["t2d"], vocab.t2d)
    assert torch.equal(draft_to_target(tensors["d2t"]), vocab.draft_ids)
    assert torch.equal(tensors["fc.weight"], m.fc.weight.detach().bfloat16())

    back, d2t, t2d = load_exported(out)
    assert type(back) is type(m) and back.config == cfg
    assert torch.equal(d2t, vocab.d2t) and torch.equal(t2d, vocab.t2d)
    for k, v in m.trainable_state_dict().items():
        assert torch.equal(back.state_dict()[k], v.bfloat16().float()), k


def test_export_vllm_llama_names_and_refusals(tmp_path):
    m, cfg, vocab, out = _tiny_export("llama", tmp_path)
    conf = json.loads((out / "config.json").read_text())
    assert (
        conf["head_dim"] == 8
        and conf["num_key_value_heads"] == 2
        and conf["tie_word_embeddings"] is False
    )
    tensors = load_file(str(out / "model.safetensors"))
    assert set(tensors) == set(VLLM_WEIGHT_NAMES) == set(VLLM_TINY)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == VLLM_TINY

    # a re-export replaces the folder (new weights, nothing of the old left, no temporary left)
    with torch.no_grad():
        m.fc.weight.add_(1.0)
    assert export_vllm(m, None, vocab.d2t, vocab.t2d, out) == out
    again = load_file(str(out / "model.safetensors"))
    assert torch.equal(again["fc.weight"], m.fc.weight.detach().bfloat16())
    assert not torch.equal(again["fc.weight"], tensors["fc.weight"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft"]
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    # a bad mapping is refused before anything is written
    with pytest.raises(ValueError, match="inconsistent"):
        export_vllm(m, cfg, vocab.d2t + 1, vocab.t2d, tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


def test_export_speculators_roundtrip(tmp_path):
    torch.manual_seed(4)
    cfg = tiny_cfg()
    m = Eagle3Draft(cfg)
    vocab = tiny_vocab(cfg)
    out = export_speculators(
        m, cfg, vocab.d2t, vocab.t2d, tmp_path / "spec", verifier="/models/target"
    )
    conf = json.loads((out / "config.json").read_text())
    assert "model_type" not in conf and conf["speculators_model_type"] == "eagle3"
    assert conf["speculators_config"]["verifier"]["name_or_path"] == "/models/target"
    assert conf["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert conf["transformer_layer_config"]["model_type"] == "llama"
    assert conf["norm_before_residual"] is False  # vLLM's speculators default would be True
    assert conf["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    tensors = load_file(str(out / "model.safetensors"))
    expected = {k.replace("midlayer.", "layers.0."): v for k, v in VLLM_TINY.items()}
    assert {k: tuple(v.shape) for k, v in tensors.items()} == expected
    back, d2t, t2d = load_exported(out)
    assert back.config == cfg and torch.equal(d2t, vocab.d2t) and torch.equal(t2d, vocab.t2d)


def test_later_layers_follow_vllms_fused_norms():
    """A 3-layer draft = llama_eagle3.py's forward written out: each layer returns (hidden,
    residual) apart, the next layer's input_layernorm adds them before it normalises (vLLM's
    fused add-norm), the final norm adds the last pair; ``out`` is that pre-norm sum."""
    torch.manual_seed(6)
    m = Eagle3Draft(tiny_cfg(num_layers=3)).eval()
    b, t = 2, 7
    ids = torch.randint(0, 100, (b, t))
    aux = torch.randn(b, t, m.config.fc_input_size)
    with torch.no_grad():
        out, logits = m(ids, aux)
        cos, sin = m.rotary(torch.arange(t).expand(b, t), aux.dtype)
        l0 = m.midlayer
        residual = m.fc(aux)
        x = torch.cat([l0.input_layernorm(m.embed_tokens(ids)), l0.hidden_norm(residual)], -1)
        residual = l0.self_attn(x, cos, sin, None, None)[0] + residual
        hidden = l0.mlp(l0.post_attention_layernorm(residual))
        for layer in m.layers.values():
            residual = hidden + residual  # input_layernorm(hidden, residual)
            a = layer.self_attn(layer.input_layernorm(residual), cos, sin, None, None)[0]
            residual = a + residual  # post_attention_layernorm(a, residual)
            hidden = layer.mlp(layer.post_attention_layernorm(residual))
        prenorm = hidden + residual  # norm(hidden, residual)
    torch.testing.assert_close(out, prenorm)
    torch.testing.assert_close(logits, m.lm_head(m.norm(prenorm)))
    assert list(m.layers) == ["1", "2"] and m.layers["1"].self_attn.q_proj.in_features == 32


def test_multi_layer_export_roundtrip(tmp_path):
    """vLLM loads layers 1.. by their own names (``layers.{j}.*``, H-wide q/k/v) and builds
    ``num_hidden_layers`` of them; both formats carry it and load back to the same draft."""
    torch.manual_seed(5)
    cfg = tiny_cfg(num_layers=2)
    m = Eagle3Draft(cfg).eval()
    vocab = tiny_vocab(cfg)
    ids, aux = torch.randint(0, 100, (1, 6)), torch.randn(1, 6, cfg.fc_input_size)
    for fmt, out in [
        ("vllm", export_vllm(m, cfg, vocab.d2t, vocab.t2d, tmp_path / "v", dtype=torch.float32)),
        (
            "speculators",
            export_speculators(
                m, cfg, vocab.d2t, vocab.t2d, tmp_path / "s", verifier="t", dtype=torch.float32
            ),
        ),
    ]:
        conf = json.loads((out / "config.json").read_text())
        layer = conf.get("transformer_layer_config", conf)
        assert layer["num_hidden_layers"] == 2, fmt
        names = set(load_file(str(out / "model.safetensors")))
        assert {n for n in names if n.startswith("layers.1.")} == {
            f"layers.1.{n}"
            for n in (
                "input_layernorm.weight",
                "self_attn.q_proj.weight",
                "self_attn.k_proj.weight",
                "self_attn.v_proj.weight",
                "self_attn.o_proj.weight",
                "post_attention_layernorm.weight",
                "mlp.gate_proj.weight",
                "mlp.up_proj.weight",
                "mlp.down_proj.weight",
            )
        }, fmt
        back, _, _ = load_exported(out)
        back.embed_tokens.weight.data.copy_(m.embed_tokens.weight)
        assert back.config == cfg, fmt
        with torch.no_grad():
            torch.testing.assert_close(back(ids, aux)[1], m(ids, aux)[1])


def test_vllm_loader_names_from_source():
    """The names we export are the ones llama_eagle3.py's loader maps onto its parameters
    (checked against the installed vLLM source when it is there)."""
    from tests.conftest import ROOT

    candidates = list(
        (ROOT / ".venv-vllm" / "lib").glob(
            "python*/site-packages/vllm/model_executor/models/llama_eagle3.py"
        )
    )
    candidates += [
        Path(
            "/tmp/venv-vllm-test/lib/python3.11/site-packages/vllm/model_executor/models/"
            "llama_eagle3.py"
        )
    ]
    src = next((p.read_text() for p in candidates if p.is_file()), None)
    if src is None:
        pytest.skip("vLLM source not installed here")
    assert '"midlayer.": "layers.0."' in src
    for stacked in ('".q_proj": (".qkv_proj", "q")', '".gate_proj": (".gate_up_proj", 0)'):
        assert stacked in src
    assert 'name.replace("d2t", "draft_id_to_target_id")' in src and '"t2d" in name' in src
    assert "torch.cat([embeds, hidden_states], dim=-1)" in src  # embeddings first
    assert "qkv_input_size = 2 * self.hidden_size if layer_idx == 0 else self.hidden_size" in src
    # layers 1..: one per num_hidden_layers, the stream through fused add-norms (what
    # test_later_layers_follow_vllms_fused_norms writes out)
    assert "for layer_idx in range(self.config.num_hidden_layers)" in src
    assert "hidden_states, residual = self.input_layernorm(hidden_states, residual)" in src
    for n in (
        "input_layernorm",
        "hidden_norm",
        "post_attention_layernorm",
        "self.fc",
        "self.norm",
        "lm_head",
    ):
        assert n in src


# ------------------------------------------------------------------------------------------------
# (d), (e) served by the real vLLM CPU server
# ------------------------------------------------------------------------------------------------


@pytest.mark.vllm
def test_vllm_serves_speculators_format(speculators_server):
    """vLLM 0.32 serves the speculators format as the served model (``vllm serve DRAFT``: it loads
    the verifier named in the config, 3 tokens from it): a random-weight draft for SmolLM2 with a
    4096-row vocab (tests/conftest.py's ``speculators_server``, whose one start the server-death
    test of tests/test_generate_vllm.py reuses). The vLLM format is served by the verify test
    (tests/test_verify.py), with the pipeline's own trained draft."""
    from eagle3.serving.client import chat

    server = speculators_server.get()
    before = spec_counters(server.base_url)
    r = chat(server.base_url, server.model, "What is the capital of France?", max_tokens=24)
    after = spec_counters(server.base_url)
    log = server.log_path.read_text() if server.log_path else ""
    assert r.content and r.completion_token_ids
    # greedy: a random draft must not change the answer (rejected drafts keep the target's tokens)
    assert "paris" in r.content.lower(), r.content
    # the embedding is not in the export: vLLM must share the target's, and keep our lm_head
    assert "without its own embed_tokens" in log and "distinct lm_head" in log, log[-3000:]
    assert "(2, 15, 27)" in log  # the aux layers reached the target
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    assert delta.get("vllm:spec_decode_num_drafts_total", 0) > 0, delta
    assert (
        delta.get("vllm:spec_decode_num_draft_tokens_total", 0)
        == 3 * delta["vllm:spec_decode_num_drafts_total"]
    )


def test_checkpoint_dir_finds_a_hub_id_in_the_local_cache_and_never_downloads(
    tmp_path, monkeypatch, smol_model
):
    """Production profiles name the target by hub id (vLLM downloads it); train needs its files."""
    from huggingface_hub import constants

    from eagle3.target_checkpoint import checkpoint_dir

    assert checkpoint_dir(smol_model) == Path(smol_model)
    cache = tmp_path / "hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    with pytest.raises(
        FileNotFoundError,
        match=r"target org/tiny: not a local folder, and not in the local "
        r"Hugging Face cache .*set target.model",
    ):
        checkpoint_dir("org/tiny")
    # the cache layout vLLM's download leaves: refs/main -> snapshots/<revision>/
    snap = cache / "models--org--tiny" / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (cache / "models--org--tiny" / "refs").mkdir()
    (cache / "models--org--tiny" / "refs" / "main").write_text("a" * 40)
    assert checkpoint_dir("org/tiny") == snap
    with pytest.raises(FileNotFoundError, match="no such folder"):
        checkpoint_dir(tmp_path / "missing")


def test_flops_count_every_layer():
    """MFU's numerator (eagle3/train/flops.py) counts each decoder layer's weights and attention
    pairs once per pass; fc and the head stay one each."""
    from eagle3.train.flops import flops_per_token, layer_params

    one, three = Eagle3Draft(tiny_cfg()), Eagle3Draft(tiny_cfg(num_layers=3))
    later = sum(p.numel() for p in three.layers["1"].parameters() if p.dim() >= 2)
    assert layer_params(three) == layer_params(one) + 2 * later
    assert later < layer_params(one)  # q/k/v read H, not 2H
    f1 = flops_per_token(one.config, layer_params(one), 64, 3)
    f3 = flops_per_token(three.config, layer_params(three), 64, 3)
    assert f3["attention"] == 3 * f1["attention"]
    assert f3["layer"] == 6.0 * layer_params(three) * 3
    assert (f3["fc"], f3["lm_head"]) == (f1["fc"], f1["lm_head"])
