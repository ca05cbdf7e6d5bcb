"""Tiny random-weight stand-ins for targets that cannot run here.

Kimi-K2.5 is a DeepSeek-V3-architecture model (MLA attention, MoE). A few-layer random
DeepseekV3 made by transformers exercises the same code paths (layer hooks, MLA shapes,
MoE routing) on a CPU in seconds. The settings follow what vLLM's CPU backend needs
(docs/extract.md; docs/train.md, "Draft architectures"): a 576-wide MLA latent (kv_lora_rank
512 + qk_rope_head_dim 64) and ``noaux_tc`` routing with sigmoid scores and an
``e_score_correction_bias`` per MoE layer, as the real checkpoints have. The tokenizer is borrowed
from a real model (SmolLM2), so the stand-in tokenises real text.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

TINY_DEEPSEEK_V3 = dict(
    vocab_size=49152,
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=128,
    num_hidden_layers=6,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    routed_scaling_factor=2.5,
    topk_method="noaux_tc",
    scoring_func="sigmoid",
    norm_topk_prob=True,
    q_lora_rank=128,
    kv_lora_rank=512,
    qk_nope_head_dim=64,
    qk_rope_head_dim=64,
    v_head_dim=64,
    max_position_embeddings=4096,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)


def make_tiny_deepseek_v3(out: Path, tokenizer_from: Path, seed: int = 0, **overrides) -> Path:
    """Build, save and return a tiny random DeepseekV3ForCausalLM folder (idempotent)."""
    from transformers import AutoTokenizer, DeepseekV3Config, DeepseekV3ForCausalLM

    out = Path(out)
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    tok = AutoTokenizer.from_pretrained(tokenizer_from)
    settings = {**TINY_DEEPSEEK_V3, **overrides}
    config = DeepseekV3Config(
        **settings,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(config).to(torch.bfloat16)
    # The real checkpoints carry a float32 routing bias per MoE layer (noaux_tc); vLLM expects it.
    for module in model.modules():
        if hasattr(module, "e_score_correction_bias"):
            module.e_score_correction_bias = module.e_score_correction_bias.float()
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    # save_pretrained, not a raw state_dict: transformers 5 holds the experts fused
    # (mlp.experts.gate_up_proj [E, 2I, H]) but saves them back per expert
    # (mlp.experts.{i}.{gate,up,down}_proj.weight), the layout of the real checkpoints and the
    # only one vLLM's DeepseekV2 loader reads; transformers fuses them again on load.
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / "eagle3-tiny.json").write_text(
        json.dumps({"kind": "deepseek_v3", "seed": seed, "settings": settings})
    )
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
