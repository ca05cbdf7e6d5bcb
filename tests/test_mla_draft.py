"""The MLA draft (eagle3.draft.mla): vLLM's Eagle3DeepseekV2ForCausalLM in PyTorch, its export, training
through the unchanged TTT loop, and the real vLLM CPU server serving it.

The vllm-marked tests start ONE server (module fixture): the tiny random DeepSeek-V3 target of
``embedded:tiny-deepseek-v3`` with an exported MLA draft (Kimi-K2.5's YaRN RoPE settings) as its
eagle3 speculative model. A probe (tests/vllm_probe/sitecustomize.py) records what the served draft
computes, and the PyTorch draft replays it: the prefill pass over the prompt (causal MLA over T
positions) and the decode steps (one query over the cached prefix).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3.draft import build_draft
from eagle3.draft.export import MLA_ARCHITECTURE, export_speculators, export_vllm, load_exported
from eagle3.draft.mla import (
    Eagle3MLADraft,
    MLADraftConfig,
    apply_rope_interleaved,
    mla_rope,
    mla_weight_shapes,
    yarn_get_mscale,
)
from eagle3.vocab import build_vocab
from tests.conftest import ROOT, require_vllm, spec_counters

TINY_PROFILE = ROOT / "configs" / "tiny-deepseek-cpu.yaml"
KIMI_TARGET_CONFIG = ROOT / "configs" / "targets" / "moonshotai--Kimi-K2.5.json"
KIMI_YARN = {
    "rope_type": "yarn",
    "factor": 64.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
#: Kimi-K2.5's MLA draft: 896,169,984 trainable weights + the frozen 163840 x 7168 embedding.
KIMI_TRAINABLE, KIMI_FROZEN = 896_169_984, 163840 * 7168


def tiny_cfg(**kw) -> MLADraftConfig:
    base = dict(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        q_lora_rank=16,
        kv_lora_rank=24,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=6,
        vocab_size=100,
        draft_vocab_size=40,
        target_hidden_size=24,
        aux_layer_ids=[1, 2, 3],
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=128,
    )
    base.update(kw)
    return MLADraftConfig(**base)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.fixture(scope="module")
def tiny_target(smol_model) -> Path:
    """embedded:tiny-deepseek-v3, built once into the machine cache (SmolLM2's tokenizer)."""
    from eagle3.config import load_config
    from eagle3.embedded import prepare_model

    cfg = load_config(TINY_PROFILE)
    return prepare_model(cfg.paths.cache_dir, cfg.target.embedded_name)


# ------------------------------------------------------------------------------------------------
# (a) config from the target
# ------------------------------------------------------------------------------------------------


def test_config_from_tiny_deepseek_v3(tiny_target):
    from eagle3.tiny import TINY_DEEPSEEK_V3 as T

    cfg = MLADraftConfig.from_target(tiny_target, 2048, [1, 3, 4])
    assert (
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.q_lora_rank,
        cfg.kv_lora_rank,
        cfg.qk_nope_head_dim,
        cfg.qk_rope_head_dim,
        cfg.v_head_dim,
    ) == (256, T["num_attention_heads"], T["q_lora_rank"], 512, 64, 64, 64)
    assert (
        cfg.intermediate_size == T["intermediate_size"] == 512
    )  # the dense MLP width, not moe_intermediate_size
    assert cfg.fc_input_size == 3 * 256 and cfg.vocab_size == 49152 and cfg.rope_type == "default"
    m = build_draft(tiny_target, 2048, [1, 3, 4], arch="mla")
    assert isinstance(m, Eagle3MLADraft) and m.config == cfg
    embed = load_file(str(tiny_target / "model.safetensors"))["model.embed_tokens.weight"]
    assert (
        torch.equal(m.embed_tokens.weight, embed.float())
        and not m.embed_tokens.weight.requires_grad
    )


def test_tiny_target_is_an_embedded_target(tiny_target, tmp_path):
    """`embedded:tiny-deepseek-v3`: built once into the machine cache; prepare-model, make-tiny-target,
    resolve_model and the plan all name the same folder."""
    from typer.testing import CliRunner

    from eagle3.cli import app
    from eagle3.embedded import EmbeddedModelError, planned_path, resolve_model

    assert (
        tiny_target.name.startswith("tiny-deepseek-v3-")
        and (tiny_target / "tokenizer.json").is_file()
    )
    runner = CliRunner()
    r = runner.invoke(app, ["prepare-model", "-c", str(TINY_PROFILE)])
    assert r.exit_code == 0 and r.output.split()[0] == str(tiny_target), r.output
    r = runner.invoke(app, ["make-tiny-target", "deepseek-v3", "-c", str(TINY_PROFILE)])
    assert r.exit_code == 0 and r.output.strip().splitlines()[-1] == str(tiny_target), r.output
    assert resolve_model("embedded:tiny-deepseek-v3", tiny_target.parent.parent) == str(tiny_target)
    assert planned_path(tmp_path, "tiny-deepseek-v3") == (
        tmp_path / "models" / tiny_target.name,
        "not prepared yet",
    )
    with pytest.raises(EmbeddedModelError, match="not prepared yet"):
        resolve_model("embedded:tiny-deepseek-v3", tmp_path)


def test_config_from_kimi_k25():
    """Kimi-K2.5 (checked-in config: text_config wrapper, YaRN x64) -> the draft's sizes and RoPE."""
    cfg = MLADraftConfig.from_target(KIMI_TARGET_CONFIG, 32000, [2, 30, 58])
    assert (
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.q_lora_rank,
        cfg.kv_lora_rank,
        cfg.qk_nope_head_dim,
        cfg.qk_rope_head_dim,
        cfg.v_head_dim,
        cfg.intermediate_size,
    ) == (7168, 64, 1536, 512, 128, 64, 128, 18432)
    assert cfg.vocab_size == 163840 and cfg.rope_theta == 50000.0 and cfg.rope_type == "yarn"
    assert cfg.rope_scaling == KIMI_YARN
    inv, magnitude, scale = mla_rope(cfg)
    m = 0.1 * math.log(64) + 1
    assert inv.shape == (32,) and magnitude == pytest.approx(
        1.0
    )  # mscale / mscale_all_dim cancel on cos/sin
    assert scale == pytest.approx(192**-0.5 * m * m) and m * m == pytest.approx(2.0047, abs=1e-4)
    shapes = mla_weight_shapes(cfg)
    assert shapes["midlayer.self_attn.q_a_proj.weight"] == (1536, 2 * 7168)
    assert shapes["midlayer.self_attn.kv_a_proj_with_mqa.weight"] == (576, 2 * 7168)
    assert shapes["midlayer.self_attn.kv_b_proj.weight"] == (64 * 256, 512)
    assert sum(math.prod(s) for s in shapes.values()) == KIMI_TRAINABLE
    with pytest.raises(TypeError, match="num_key_value_heads does not apply"):
        MLADraftConfig.from_target(KIMI_TARGET_CONFIG, 32000, [2, 30, 58], num_key_value_heads=8)


def test_config_refuses_llama_targets_and_unsupported_rope(smol_model):
    with pytest.raises(ValueError, match="no MLA fields"):
        MLADraftConfig.from_target(smol_model, 4096, [2, 15, 27])
    with pytest.raises(ValueError, match="distinct"):
        tiny_cfg(aux_layer_ids=[1, 1, 2])
    with pytest.raises(ValueError, match="DeepSeek YaRN"):
        tiny_cfg(rope_scaling={"rope_type": "llama3", "factor": 8.0})
    with pytest.raises(ValueError, match="unknown draft arch"):
        build_draft(smol_model, 4096, [2, 15, 27], arch="gpt")


def test_draft_arch_resolution():
    from eagle3.config import load_config
    from tests.conftest import CPU_PROFILE, KIMI_PROFILE

    assert (
        load_config(KIMI_PROFILE).draft_arch == "mla"
        and load_config(TINY_PROFILE).draft_arch == "mla"
    )
    assert load_config(CPU_PROFILE).draft_arch == "llama"  # auto, llama target
    assert load_config(CPU_PROFILE, ["target.architecture=deepseek_v3"]).draft_arch == "mla"  # auto
    assert load_config(KIMI_PROFILE, ["train.draft_arch=llama"]).draft_arch == "llama"


# ------------------------------------------------------------------------------------------------
# (b) forward: shapes, masks, KV prefix, TTT, against transformers' DeepseekV3Attention
# ------------------------------------------------------------------------------------------------


# (shapes, forward/backward, masks and the KV prefix: tests/test_draft_model.py, parametrized over both drafts)


def test_ttt_unroll_matches_per_position_reference():
    """train.ttt_unroll, unchanged, on the MLA draft: step i at t == the chain computed one token at a time."""
    from eagle3.train import Batch, step_inputs, ttt_unroll

    torch.manual_seed(2)
    cfg = tiny_cfg(rope_scaling=dict(KIMI_YARN, original_max_position_embeddings=16))
    model = Eagle3MLADraft(cfg).eval()
    T = 7
    ids = torch.randint(0, cfg.vocab_size, (1, T))
    b = Batch(
        ids,
        torch.randn(1, T, cfg.fc_input_size),
        torch.zeros(1, T, 40),
        torch.zeros(1, T, dtype=torch.long),
        torch.ones(1, T, dtype=torch.bool),
    )
    with torch.no_grad():
        outs = [(o, lg) for _, o, lg in ttt_unroll(model, b, 3)]
        _, _, kv0 = model(step_inputs(b, 0)[0], b.aux, use_cache=True)
        for t in range(T):
            past = (kv0[0][:, :, : t + 1], kv0[1][:, :, : t + 1])
            hidden = outs[0][0][:, t : t + 1]
            for i in (1, 2):
                x = step_inputs(b, i)[0][:, t : t + 1]
                o, lg, kv = model(
                    x, hidden, position_ids=torch.tensor([t + i]), past_kv=past, use_cache=True
                )
                torch.testing.assert_close(o, outs[i][0][:, t : t + 1], atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(lg, outs[i][1][:, t : t + 1], atol=1e-5, rtol=1e-5)
                past = (torch.cat([past[0], kv[0]], 2), torch.cat([past[1], kv[1]], 2))
                hidden = o


@pytest.mark.parametrize("q_lora_rank", [16, None])
@pytest.mark.parametrize("rope", ["default", "kimi_yarn"])
def test_attention_matches_transformers_deepseek_v3(q_lora_rank, rope):
    """Our MLA attention against transformers' DeepseekV3Attention (interleaved RoPE, YaRN, mscale^2
    softmax scale), its 2H-input projections widened as vLLM's input_size does."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3Attention,
        DeepseekV3RotaryEmbedding,
    )

    torch.manual_seed(3)
    scaling = dict(KIMI_YARN, original_max_position_embeddings=8) if rope == "kimi_yarn" else None
    cfg = tiny_cfg(
        q_lora_rank=q_lora_rank, rope_scaling=scaling, rms_norm_eps=1e-6
    )  # HF's latent norms: 1e-6
    m = Eagle3MLADraft(cfg).eval()
    ours = m.midlayer.self_attn
    q_out = ours.q_b_proj if q_lora_rank else ours.q_proj
    with torch.no_grad():  # sharper attention than the init gives, so RoPE and scale matter
        for w in (q_out.weight, ours.kv_b_proj.weight, ours.kv_a_proj_with_mqa.weight):
            w.mul_(8.0)
    rope_parameters = (
        {"rope_type": "default", "rope_theta": 10000.0}
        if scaling is None
        else {**scaling, "rope_theta": 10000.0}
    )
    hf_cfg = DeepseekV3Config(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=24,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=6,
        rms_norm_eps=1e-5,
        max_position_embeddings=128,
        rope_parameters=rope_parameters,
        rope_interleave=True,
        attention_bias=False,
    )
    hf_cfg._attn_implementation = "sdpa"
    attn = DeepseekV3Attention(hf_cfg, layer_idx=0).eval()
    names = ["kv_a_proj_with_mqa"] + (["q_a_proj"] if q_lora_rank else ["q_proj"])
    for name in names:
        setattr(attn, name, torch.nn.Linear(64, getattr(ours, name).out_features, bias=False))
    attn.load_state_dict(ours.state_dict())
    x = torch.randn(2, 6, 64)
    pos = torch.arange(3, 9).unsqueeze(0).expand(2, 6)
    with torch.no_grad():
        cos, sin = m.rotary(pos, x.dtype)
        got, _ = ours(x, cos, sin, None, None)
        hf_cos, hf_sin = DeepseekV3RotaryEmbedding(hf_cfg)(x, pos)
        want = attn(x, (hf_cos, hf_sin), attention_mask=None)[0]
    assert attn.scaling == pytest.approx(ours.softmax_scale, rel=1e-6)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


def test_rope_is_interleaved_and_yarn_matches_transformers():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

    cfg = MLADraftConfig.from_target(KIMI_TARGET_CONFIG, 32000, [2, 30, 58])
    inv, magnitude, _ = mla_rope(cfg)
    hf = DeepseekV3RotaryEmbedding(
        DeepseekV3Config(
            hidden_size=7168,
            num_attention_heads=64,
            qk_rope_head_dim=64,
            max_position_embeddings=262144,
            rope_parameters={**KIMI_YARN, "rope_theta": 50000.0},
        )
    )
    assert torch.allclose(inv, hf.inv_freq.float(), rtol=1e-5)
    assert magnitude == pytest.approx(float(hf.attention_scaling), rel=1e-6)
    assert yarn_get_mscale(64.0, 1.0) == pytest.approx(1.4159, abs=1e-4)
    # interleaved pairs: (x0, x1) rotate together
    x = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    cos, sin = torch.tensor([[0.0, 0.0, 1.0, 1.0]]), torch.tensor([[1.0, 1.0, 0.0, 0.0]])
    assert apply_rope_interleaved(x, cos, sin).tolist() == [[0.0, 1.0, 0.0, 0.0]]


# ------------------------------------------------------------------------------------------------
# (c) export and load back
# ------------------------------------------------------------------------------------------------


def test_export_vllm_mla_fields_and_refusals(tmp_path):
    """The MLA export's own fields (what the shared roundtrip in tests/test_draft_model.py does not check)."""
    from tests.test_draft_model import _tiny_export

    m, cfg, vocab, out = _tiny_export("mla", tmp_path)
    conf = json.loads((out / "config.json").read_text())
    assert conf["architectures"] == [MLA_ARCHITECTURE] and conf["model_type"] == "deepseek_v2"
    assert (
        conf["q_lora_rank"],
        conf["kv_lora_rank"],
        conf["qk_nope_head_dim"],
        conf["qk_rope_head_dim"],
        conf["v_head_dim"],
        conf["intermediate_size"],
        conf["num_hidden_layers"],
    ) == (16, 24, 8, 8, 6, 64, 1)
    assert conf["rope_scaling"]["rope_type"] == "yarn" and conf["rope_scaling"]["factor"] == 64.0
    assert (
        conf["rope_parameters"]["rope_theta"] == 10000.0 and conf["norm_before_residual"] is False
    )

    with pytest.raises(ValueError, match="speculators format"):
        export_speculators(m, cfg, vocab.d2t, vocab.t2d, tmp_path / "spec", verifier="/x")
    no_q_lora = Eagle3MLADraft(tiny_cfg(q_lora_rank=None))
    with pytest.raises(ValueError, match="q_lora_rank"):
        export_vllm(no_q_lora, None, vocab.d2t, vocab.t2d, tmp_path / "no-q-lora")
    assert not (tmp_path / "spec").exists() and not (tmp_path / "no-q-lora").exists()


def _vllm_source(name: str) -> str:
    p = next(
        (ROOT / ".venv-vllm" / "lib").glob(f"python*/site-packages/vllm/model_executor/{name}"),
        None,
    )
    if p is None:
        pytest.skip("vLLM source not installed here")
    return p.read_text()


def test_vllm_loader_and_layer_from_source():
    """What this module mirrors, as vLLM 0.32's source states it."""
    src = _vllm_source("models/deepseek_eagle3.py")
    assert 'orig_to_new_substr={"midlayer.": "layers.0."}' in src
    for stacked in (
        '".q_a_proj": (".fused_qkv_a_proj", 0)',
        '".kv_a_proj_with_mqa": (".fused_qkv_a_proj", 1)',
        '".gate_proj": (".gate_up_proj", 0)',
    ):
        assert stacked in src
    assert 'name.replace("d2t", "draft_id_to_target_id")' in src and '"t2d" in name' in src
    assert "torch.cat([embeds, hidden_states], dim=-1)" in src  # embeddings first
    assert "input_size=2 * self.hidden_size if layer_idx == 0" in src
    assert (
        "self.mlp = DeepseekV2MLP(" in src and "intermediate_size=config.intermediate_size" in src
    )
    v2 = _vllm_source("models/deepseek_v2.py")
    assert "is_neox_style=False" in v2 and "self.scaling = self.scaling * mscale * mscale" in v2
    assert (
        '"deepseek_llama_scaling"\n                if config.rope_parameters.get("attention_factor") == 1.0'
        in v2
    )


# ------------------------------------------------------------------------------------------------
# (d) the train stage builds, trains and exports it (draft_arch: mla)
# ------------------------------------------------------------------------------------------------


def test_train_stage_trains_and_exports_the_mla_draft(tmp_path):
    from eagle3.train import train
    from tests.test_train import DRAFT_V, H, V, make_cfg, make_data, make_vocab

    target = tmp_path / "target"
    target.mkdir()
    embed = torch.randn(V, H, generator=torch.Generator().manual_seed(0))
    (target / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["DeepseekV3ForCausalLM"],
                "model_type": "deepseek_v3",
                "hidden_size": H,
                "num_attention_heads": 4,
                "num_key_value_heads": 4,
                "num_hidden_layers": 4,
                "intermediate_size": 128,
                "moe_intermediate_size": 32,
                "q_lora_rank": 32,
                "kv_lora_rank": 32,
                "qk_nope_head_dim": 16,
                "qk_rope_head_dim": 16,
                "v_head_dim": 16,
                "vocab_size": V,
                "tie_word_embeddings": True,
                "rms_norm_eps": 1e-5,
                "max_position_embeddings": 256,
                "rope_theta": 10000.0,
                "hidden_act": "silu",
            }
        )
    )
    save_file(
        {"model.embed_tokens.weight": embed, "model.norm.weight": torch.full((H,), 0.15)},
        str(target / "model.safetensors"),
    )
    ext = make_data(tmp_path / "extract", embed, n=16)
    vocab = make_vocab(ext, tmp_path / "vocab.safetensors")
    cfg = make_cfg(epochs=6, lr=1e-2, ttt_steps=2, draft_arch="mla")
    man = train(cfg, ext, vocab, target, tmp_path / "run")
    assert man["complete"] and man["draft_config"]["kv_lora_rank"] == 32
    hist = json.loads((tmp_path / "run" / "metrics.json").read_text())["epochs"]
    assert hist[-1]["loss"][0] < 0.8 * hist[0]["loss"][0]
    conf = json.loads((Path(man["export"]) / "config.json").read_text())
    assert conf["architectures"] == [MLA_ARCHITECTURE] and conf["intermediate_size"] == 128
    back, d2t, _ = load_exported(man["export"])
    assert (
        isinstance(back, Eagle3MLADraft)
        and back.config.draft_vocab_size == DRAFT_V
        and d2t is not None
    )


# ------------------------------------------------------------------------------------------------
# (e) served by the real vLLM CPU server next to the tiny DeepSeek-V3 target
# ------------------------------------------------------------------------------------------------

PROMPTS = [
    (
        "Once upon a time, in a small village by the sea, there lived an old fisherman who told stories "
        "about the stars, the tides and the winds to every child who would listen."
    ),
    "What is the capital of France?",
]


@pytest.fixture(scope="module")
def served(tiny_target, tmp_path_factory):
    """ONE server: tiny DeepSeek-V3 + a random MLA draft (Kimi's YaRN RoPE, sharpened attention) as
    eagle3 draft with 3 tokens, the probe recording the draft's calls during the first request."""
    from eagle3.config import load_config
    from eagle3.serving.server import start_server

    work = tmp_path_factory.mktemp("mla-served")
    cfg = load_config(TINY_PROFILE, ["serve.port=0"])
    require_vllm(cfg)
    torch.manual_seed(5)
    counts = torch.zeros(49152, dtype=torch.int64)
    ids = torch.randint(0, 49152, (20000,))
    counts.index_add_(0, ids, torch.ones_like(ids))
    counts[:300] += 100
    vocab = build_vocab(counts, 2048)
    # The draft's RoPE need not be the target's: Kimi-K2.5's YaRN x64 exercises vLLM's deepseek_yarn path.
    model = build_draft(tiny_target, 2048, [1, 3, 4], arch="mla", rope_scaling=dict(KIMI_YARN))
    with (
        torch.no_grad()
    ):  # sharper attention than the init gives: RoPE layout and softmax scale then matter
        a = model.midlayer.self_attn
        for w in (a.q_b_proj.weight, a.kv_b_proj.weight, a.kv_a_proj_with_mqa.weight):
            w.mul_(6.0)
    draft = export_vllm(model, None, vocab.d2t, vocab.t2d, work / "draft")
    probe = work / "probe"
    probe.mkdir()
    env = {
        **cfg.serve.env,
        "EAGLE3_DRAFT_PROBE_DIR": str(probe),
        "PYTHONPATH": str(ROOT / "tests" / "vllm_probe"),
    }
    cfg = cfg.model_copy(update={"serve": cfg.serve.model_copy(update={"env": env})})
    spec = {"method": "eagle3", "model": str(draft), "num_speculative_tokens": 3}
    with start_server(
        cfg, str(tiny_target), speculative_config=spec, log_dir=work / "logs"
    ) as server:
        print(f"\ntiny DeepSeek-V3 + MLA draft ready in {server.ready_s:.1f} s")
        before = spec_counters(server.base_url)
        answers = []
        with httpx.Client(base_url=server.base_url, timeout=300) as c:
            for i, prompt in enumerate(PROMPTS):
                if i == 0:
                    (probe / "armed").touch()
                r = c.post(
                    "/v1/completions",
                    json={
                        "model": server.model,
                        "prompt": prompt,
                        "max_tokens": 16,
                        "temperature": 0,
                    },
                )
                (probe / "armed").unlink(missing_ok=True)
                assert r.status_code == 200, r.text
                answers.append(r.json())
        after = spec_counters(server.base_url)
        log = server.log_path.read_text() if server.log_path else ""
    yield {
        "answers": answers,
        "delta": {k: after[k] - before.get(k, 0.0) for k in after},
        "log": log,
        "draft": draft,
        "probe": probe,
        "target": tiny_target,
    }


@pytest.mark.vllm
def test_vllm_serves_the_mla_draft(served):
    delta, log = served["delta"], served["log"]
    assert all(a["usage"]["completion_tokens"] == 16 for a in served["answers"])
    assert "Resolved architecture: Eagle3DeepseekV2ForCausalLM" in log
    assert "without its own embed_tokens" in log and "distinct lm_head" in log, log[-3000:]
    assert "(1, 3, 4)" in log  # the aux layers reached the target
    print(f"spec-decode counter deltas: {delta}")
    assert delta.get("vllm:spec_decode_num_drafts_total", 0) > 0, delta
    assert (
        delta["vllm:spec_decode_num_draft_tokens_total"]
        == 3 * delta["vllm:spec_decode_num_drafts_total"]
    )


def _records(probe: Path) -> list[tuple[str, dict[str, torch.Tensor]]]:
    files = sorted(probe.glob("*.safetensors"), key=lambda p: int(p.name.split("-")[1]))
    return [(p.name.split("-")[2].removesuffix(".safetensors"), load_file(str(p))) for p in files]


def _near_tie(ours: torch.Tensor, theirs: torch.Tensor) -> tuple[bool, bool]:
    """(same argmax, vLLM's argmax is within the bf16 noise of our maximum): a random draft's logits
    are nearly flat, so a near-tie may flip under bf16 rounding."""
    noise = float((ours - theirs).abs().max())
    top = int(theirs.argmax())
    return int(ours.argmax()) == top, float(ours.max() - ours[top]) <= 2 * noise


@pytest.mark.vllm
def test_vllm_draft_computes_what_the_pytorch_draft_computes(served):
    """Replay the served draft's first proposal (prefill over the prompt, then 2 decode steps over the
    cached prefix) through the exported draft loaded in PyTorch (float32 vs vLLM's bf16)."""
    recs = _records(served["probe"])
    kinds = [k for k, _ in recs]
    assert kinds[:7] == [
        "combine",
        "forward",
        "logits",
        "forward",
        "logits",
        "forward",
        "logits",
    ], kinds[:10]
    model, d2t, _ = load_exported(served["draft"])
    model.load_embeddings(served["target"])
    model.eval()
    rows = (
        torch.arange(d2t.numel()) + d2t
    )  # vLLM's logits are over the target vocab; ours over the draft's

    combine, prefill, logits0 = recs[0][1], recs[1][1], recs[2][1]
    T = prefill["input_ids"].shape[0]
    assert combine["aux"].shape == (T, 3 * 256) and T > 30
    errors: dict[str, float] = {}
    ties: list[tuple[bool, bool]] = []  # (same argmax, vLLM's argmax within noise of ours)
    with torch.no_grad():
        errors["fc"] = rel(model.project(combine["aux"].float()), combine["fc"])
        assert torch.equal(prefill["hidden_states"], combine["fc"])
        out, lg, kv = model(
            prefill["input_ids"][None].long(),
            prefill["hidden_states"].float()[None],
            position_ids=prefill["positions"],
            use_cache=True,
        )
        errors["prefill out (pre-norm)"] = rel(out[0], prefill["prenorm"])
        errors["prefill out - input (attention + MLP)"] = rel(
            out[0] - prefill["hidden_states"].float(),
            prefill["prenorm"].float() - prefill["hidden_states"].float(),
        )
        errors["prefill norm(out)"] = rel(model.norm(out[0]), prefill["normed"])
        vllm_logits = logits0["logits"].float()[:, rows]
        errors["first logits"] = rel(lg[0, -1:], vllm_logits)
        ties.append(_near_tie(lg[0, -1], vllm_logits[0]))
        past, previous = kv, logits0
        for step in (1, 2):
            f, lgs = recs[2 * step + 1][1], recs[2 * step + 2][1]
            assert f["input_ids"].shape == (1,) and int(f["positions"]) == T - 1 + step
            assert int(f["input_ids"]) == int(
                previous["logits"].argmax()
            )  # the draft's own greedy token
            assert torch.equal(
                f["hidden_states"],
                (prefill if step == 1 else recs[2 * step - 1][1])["prenorm"][-1:],
            )
            previous = lgs
            o, l_, kv_s = model(
                f["input_ids"][None].long(),
                f["hidden_states"].float()[None],
                position_ids=f["positions"],
                past_kv=past,
                use_cache=True,
            )
            past = (torch.cat([past[0], kv_s[0]], 2), torch.cat([past[1], kv_s[1]], 2))
            vllm_logits = lgs["logits"].float()[:, rows]
            errors[f"decode step {step} out"] = rel(o[0], f["prenorm"])
            errors[f"decode step {step} logits"] = rel(l_[0], vllm_logits)
            ties.append(_near_tie(l_[0, -1], vllm_logits[0]))
        # negative control: the same replay with rotate-half (neox) RoPE is far off
        import eagle3.draft.mla as mm

        orig = mm._rotate_gptj
        mm._rotate_gptj = lambda x: torch.cat(
            [-x[..., x.shape[-1] // 2 :], x[..., : x.shape[-1] // 2]], -1
        )
        try:
            bad, _ = model(
                prefill["input_ids"][None].long(),
                prefill["hidden_states"].float()[None],
                position_ids=prefill["positions"],
            )
        finally:
            mm._rotate_gptj = orig
        control = rel(bad[0], prefill["prenorm"])
        # ... and so is the softmax scale without YaRN's mscale^2 (2.005 for Kimi's factor 64)
        attn = model.midlayer.self_attn
        scale, attn.softmax_scale = attn.softmax_scale, model.config.qk_head_dim**-0.5
        try:
            no_mscale, _ = model(
                prefill["input_ids"][None].long(),
                prefill["hidden_states"].float()[None],
                position_ids=prefill["positions"],
            )
        finally:
            attn.softmax_scale = scale
        control_scale = rel(no_mscale[0], prefill["prenorm"])
        # the noise floor: the same PyTorch draft in bf16 against itself in float32
        bf16 = load_exported(served["draft"], dtype=torch.bfloat16)[0]
        bf16.load_embeddings(served["target"])
        own, _ = bf16.eval()(
            prefill["input_ids"][None].long(),
            prefill["hidden_states"][None],
            position_ids=prefill["positions"],
        )
        floor = rel(own[0], out[0])
    print(f"\nrelative error, PyTorch float32 vs vLLM bf16 (prompt of {T} tokens):")
    for k, v in errors.items():
        print(f"  {k:40s} {v:.2e}")
    print(f"  {'control: neox RoPE, prefill out':40s} {control:.2e}")
    print(f"  {'control: no mscale^2 in the scale':40s} {control_scale:.2e}")
    print(f"  {'bf16 PyTorch vs float32 (noise floor)':40s} {floor:.2e}")
    print(f"  proposals with the same argmax: {sum(t[0] for t in ties)} of {len(ties)}")
    assert all(v < 2e-2 for v in errors.values()), errors
    assert errors["prefill out (pre-norm)"] < 2 * floor, (
        errors,
        floor,
    )  # vLLM is as close as bf16 gets
    assert all(t[1] for t in ties), ties
    assert control > 10 * errors["prefill out (pre-norm)"], (control, errors)
    assert control_scale > 5 * errors["prefill out (pre-norm)"], (control_scale, errors)
