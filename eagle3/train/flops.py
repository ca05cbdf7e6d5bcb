"""Model FLOPs per trained token of the TTT step: the numerator of MFU (bench/train.py's, and the
train stage's TensorBoard ``train/mfu``).

Counted as the work the step needs, not what an implementation happens to do (docs/train.md,
"Throughput and FLOP accounting"). Per token, with K TTT steps, N_fc = H x A*Ht, N_layer = the
decoder layer's weights (attention + MLP; norms are negligible), D x H the draft lm_head::

    fc            4 N_fc             once per token: forward + weight gradient (its input, the
                                     target's states, needs no gradient)
    layer         6 N_layer  x K     forward + both gradients, every TTT step (N_layer: all the
                                     draft's decoder layers)
    lm_head       6 D H      x K     (4 D H when frozen: no weight gradient)
    attention     6 n (dqk + dv) x sum_i ((T+1)/2 + i)   only the pairs computed: causal over
                                     step 0's keys (mean (T+1)/2 per query) and i diagonals at
                                     step i; QK^T and PV, forward (2) + backward (4); per layer
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
    parallel: int = 0,
) -> dict[str, float]:
    """The terms of the module docstring and their ``total``, FLOPs per token. ``parallel``:
    the parallel-drafting depths trained beside the TTT steps: each depth d >= 1 is one more
    pass of the layer and the head, its query seeing the causal keys and d diagonals as TTT step
    d does (eagle3.train.ttt.loss_offsets)."""
    from eagle3.train.ttt import loss_offsets

    h = cfg.hidden_size
    n_fc = h * cfg.fc_input_size
    heads, dqk, dv = attention_dims(cfg)
    offsets = loss_offsets(ttt, parallel)
    passes = len(offsets)
    pairs = sum((seq + 1) / 2 + i for i in offsets)
    terms = {
        "fc": 4.0 * n_fc,
        "layer": 6.0 * layer_params * passes,
        "lm_head": (6.0 if head_trainable else 4.0) * cfg.draft_vocab_size * h * passes,
        "attention": 6.0 * heads * (dqk + dv) * pairs * getattr(cfg, "num_layers", 1),
        "target_head": 2.0 * (cfg.draft_vocab_size if argmax_once else cfg.vocab_size) * h,
    }
    terms["total"] = sum(terms.values())
    return terms


def layer_params(model: Any) -> int:
    """Weights of the decoder layers (``midlayer``, ``layers.*``) taking part in matmuls (norms
    excluded)."""
    layers = [model.midlayer, *getattr(model, "layers", {}).values()]
    return sum(p.numel() for m in layers for p in m.parameters() if p.dim() >= 2)


#: dense bf16 peak FLOP/s by GPU name (the vendors' datasheets, SXM parts, no sparsity): MFU's
#: denominator where the train stage runs; elsewhere (the CPU, another GPU) no MFU is logged
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "B200": 2250e12}


def peak_flops(device: Any) -> float | None:
    """The dense bf16 peak of ``device`` if this table knows its GPU, else None."""
    import torch

    if getattr(device, "type", None) != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def run_flops_per_token(model: Any, tc: Any, ds: Any) -> float:
    """FLOPs per loss-eligible token of this run's step: the samples' mean length (cut to
    ``train.max_seq_len``) for the attention pairs, the frozen or trained head as configured;
    the fast step's target head at its draft rows (the full-vocab argmax once per sample)."""
    n = len(ds)
    seq = sum(min(ds.length(i), tc.max_seq_len) for i in range(n)) / max(n, 1)
    args = (round(seq), tc.ttt_steps, not tc.freeze_head, True, tc.parallel_depths)
    return flops_per_token(model.config, layer_params(model), *args)["total"]
