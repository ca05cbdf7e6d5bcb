"""What ``eagle3 plan`` and ``eagle3 preflight`` say about the two ways to get the target's states:
offline (extract stores them, train reads them back) and online (train asks the target for them,
eagle3/train/online.py). Both layouts are shown with their disk, their GPUs and the target's cost,
whichever the profile picks (``extract.states``), so a user sees what switching would change."""

from __future__ import annotations

from typing import Any

from eagle3.config import PipelineConfig

TOKEN_BYTES = 9  # what a token-only extract keeps: an int64 id and a uint8 loss mask


def tokens_bound(cfg: PipelineConfig) -> int | None:
    """Tokens of every sample at full length (None without generate.num_samples)."""
    n = cfg.generate.num_samples
    if n is None:
        return None
    return n * min(cfg.generate.max_tokens + 512, cfg.extract.max_seq_len)  # 512: a generous prompt


def state_bytes_per_token(cfg: PipelineConfig) -> int:
    """3 aux + 1 final state of the target's width, in the storage dtype (fp8: + a scale a row)."""
    h = cfg.target.hidden_size
    aux = len(cfg.aux_layers)
    if cfg.extract.storage_dtype == "bfloat16":
        return (aux + 1) * h * 2
    return (aux + 1) * h + 2 * 4


def target_flops_per_token(conf: dict[str, Any] | None) -> float | None:
    """The target's forward per token, 2 x the weights a token meets (routed experts: only the
    active ones), from its config.json; None when its fields are missing."""
    if not conf:
        return None
    t = conf.get("text_config") if isinstance(conf.get("text_config"), dict) else conf
    try:
        h, n, inter = (
            int(t["hidden_size"]),
            int(t["num_hidden_layers"]),
            int(t["intermediate_size"]),
        )
        heads = int(t["num_attention_heads"])
        if t.get("kv_lora_rank"):  # MLA
            qk = int(t["qk_nope_head_dim"]) + int(t["qk_rope_head_dim"])
            q = h * int(t["q_lora_rank"]) + int(t["q_lora_rank"]) * heads * qk
            kv = h * (int(t["kv_lora_rank"]) + int(t["qk_rope_head_dim"]))
            kv += (
                int(t["kv_lora_rank"]) * heads * (int(t["qk_nope_head_dim"]) + int(t["v_head_dim"]))
            )
            attn = q + kv + heads * int(t["v_head_dim"]) * h
        else:
            d = int(t.get("head_dim") or h // heads)
            attn = 2 * h * heads * d + 2 * h * int(t.get("num_key_value_heads") or heads) * d
        dense = 3 * h * inter
        if t.get("moe_intermediate_size"):
            active = int(t["num_experts_per_tok"]) + int(t.get("n_shared_experts") or 0)
            moe = 3 * h * int(t["moe_intermediate_size"]) * active
            k = int(t.get("first_k_dense_replace") or 0)
            mlp = k * dense + (n - k) * moe
        else:
            mlp = n * dense
    except (KeyError, TypeError, ValueError):
        return None
    return 2.0 * (n * attn + mlp)


def _gib(n: float) -> str:
    return f"{n / 1024**3:,.1f} GiB"


def states_plan(
    cfg: PipelineConfig, target_conf: dict[str, Any] | None, draft_trainable: int | None
) -> dict[str, Any]:
    """Both layouts: disk, GPUs, and the target's forward that online repeats every epoch."""
    e, s, tc = cfg.extract, cfg.serve, cfg.train
    tokens = tokens_bound(cfg)
    per_token = state_bytes_per_token(cfg)
    offline: dict[str, Any] = {
        "what": f"extract ({e.backend}) stores every token's states ({per_token:,} B a token, "
        f"{e.storage_dtype}); train reads them back every epoch",
        "disk": f"up to {_gib(tokens * per_token)} ({cfg.generate.num_samples} samples)"
        if tokens
        else f"{per_token:,} B a token (generate.num_samples unset: no bound)",
        "gpus": "extract, then train: each stage has every GPU to itself",
    }
    cache = tc.state_cache_gib * 1024**3
    online: dict[str, Any] = {
        "what": f"extract stores token ids and loss masks ({TOKEN_BYTES} B a token); train asks "
        "the "
        + (
            "target's vLLM extract server (started by train, the extract settings) for each batch"
            if e.backend == "vllm"
            else "target loaded in the training process (transformers) for each batch"
        )
        + f", {tc.online_prefetch} batches ahead, and keeps {tc.state_cache_gib:g} GiB of them",
        "disk": (f"{_gib(tokens * TOKEN_BYTES)} of tokens" if tokens else "bytes a token")
        + f" + at most {_gib(cache)} of cached states",
    }
    if e.backend == "vllm":
        util = e.online_gpu_memory_utilization or s.gpu_memory_utilization
        where = e.online_server_gpus if e.online_server_gpus is not None else "all (shared)"
        online["gpus"] = (
            f"while train runs: the target on GPUs {where} (tensor parallel "
            f"{s.tensor_parallel_size}, gpu_memory_utilization {util or 'vLLM default'}); "
            f"{tc.nproc_per_node} training rank(s) on "
            + (
                "the same GPUs, in the memory the server leaves "
                "(extract.online_gpu_memory_utilization)"
                if e.online_server_gpus is None
                else "the GPUs the server does not use (CUDA_VISIBLE_DEVICES of train)"
            )
        )
        if tc.nproc_per_node > 1:
            online["note"] = (
                "online + vllm trains in one process today (several ranks would each start a "
                "server): train.nproc_per_node 1 with train.grad_accum for the same global batch"
            )
    else:
        online["gpus"] = "the target (its weights and a forward) shares the training GPU"
    flops = target_flops_per_token(target_conf)
    if flops:
        cost = f"the target's forward, ~{flops / 1e9:,.1f} GFLOP a token, every epoch ({tc.epochs})"
        if draft_trainable:
            draft = 6.0 * draft_trainable * tc.ttt_steps
            cost += (
                f" beside the draft's ~{draft / 1e9:,.1f} GFLOP a token a step "
                f"(6 x trainable x TTT {tc.ttt_steps})"
            )
        if tokens:
            hit = min(1.0, cache / (tokens * per_token))
            cost += f"; the cache holds {hit:.1%} of the states at most"
        online["cost"] = cost
    return {"chosen": e.states, "offline": offline, "online": online}
