"""Model FLOPs per trained token of the TTT step: the numerator of bench/train.py's MFU.

Counted as the work the step needs, not what an implementation happens to do (docs/train.md,
"Throughput and FLOP accounting"). Per token, with K TTT steps, N_fc = H x A*Ht, N_layer = the
decoder layer's weights (attention + MLP; norms are negligible), D x H the draft lm_head::

    fc            4 N_fc             once per token: forward + weight gradient (its input, the
                                     target's states, needs no gradient)
    layer         6 N_layer  x K     forward + both gradients, every TTT step
    lm_head       6 D H      x K     (4 D H when frozen: no weight gradient)
    attention     6 n (dqk + dv) x sum_i ((T+1)/2 + i)   only the pairs computed: causal over
                                     step 0's keys (mean (T+1)/2 per query) and i diagonals at
                                     step i; QK^T and PV, forward (2) + backward (4)
    target head   2 V H              forward only, once per token (its distribution is computed
                                     once per sample per batch and read at an offset by every step);
                  2 D H              with ``argmax_once`` (the fast step's loader): the full-vocab
                                     argmax of a token is computed at its first batch only, later
                                     batches multiply the draft rows alone (bench/train.py times
                                     the once-per-sample pass apart)

The frozen embedding (a lookup) and elementwise work (norms, RoPE, softmax, loss) count nothing.
"""

from __future__ import annotations

from typing import Any


def attention_dims(cfg: Any) -> tuple[int, int, int]:
    """(heads, QK width, V width) per head, Llama or MLA config."""
    if hasattr(cfg, "qk_nope_head_dim"):
        return cfg.num_attention_heads, cfg.qk_head_dim, cfg.v_head_dim
    return cfg.num_attention_heads, cfg.head_dim, cfg.head_dim


def flops_per_token(
    cfg: Any,
    layer_params: int,
    seq: int,
    ttt: int,
    head_trainable: bool = True,
    argmax_once: bool = False,
) -> dict[str, float]:
    """The terms of the module docstring and their ``total``, FLOPs per token."""
    h = cfg.hidden_size
    n_fc = h * cfg.fc_input_size
    heads, dqk, dv = attention_dims(cfg)
    pairs = sum((seq + 1) / 2 + i for i in range(ttt))
    terms = {
        "fc": 4.0 * n_fc,
        "layer": 6.0 * layer_params * ttt,
        "lm_head": (6.0 if head_trainable else 4.0) * cfg.draft_vocab_size * h * ttt,
        "attention": 6.0 * heads * (dqk + dv) * pairs,
        "target_head": 2.0 * (cfg.draft_vocab_size if argmax_once else cfg.vocab_size) * h,
    }
    terms["total"] = sum(terms.values())
    return terms


def layer_params(model: Any) -> int:
    """Weights of the decoder layer (``midlayer``) taking part in matmuls (norms excluded)."""
    return sum(p.numel() for p in model.midlayer.parameters() if p.dim() >= 2)
