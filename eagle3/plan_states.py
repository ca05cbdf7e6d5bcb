"""What ``eagle3 plan`` and ``eagle3 preflight`` say about the three ways to get the target's
states, priced for the profile so that a user sees what each would cost and which the plan picks:

- **offline**: extract stores every token's states, train reads them back every epoch;
- **online** (``extract.states: online``, ``train.state_cache_gib: 0``): extract keeps token ids and
  loss masks, train asks the target for every batch's states every epoch (eagle3/train/online.py);
- **hybrid** (online with a state cache: ``train.state_cache_gib`` a number, or ``auto``, what the
  node's host memory and disk allow less a margin): epoch 1 computes every state, later epochs read
  the cached share and recompute the rest.

The prices, with T tokens an epoch, E epochs, B bytes of states a token, r_t the target's tokens/s,
r_d the trainer's tokens/s and s the share of the states the cache holds (offline 1, online 0)::

    disk      offline T*B;  online T*9;  hybrid T*9 + (cache - the part in host memory)
    target    offline T/r_t once (extract);  online/hybrid T/r_t in epoch 1, (1-s)*T/r_t after
    train     T/r_d an epoch, every layout (cached states read at offline speed)
    total     offline T/r_t + E*T/r_d
              online/hybrid, hf target (shares the training GPU): sum over epochs of target + train
              online/hybrid, vLLM target (its GPUs; training on others, overlapped):
                  sum over epochs of max(target, train)

Rates are measured where a previous run of the profile recorded them (the extract manifest's
``this_run.tokens_per_s`` of an offline extract with the profile's backend; an offline train run's
tokens x epochs / ``loop_s``), else the profile's ``plan:`` estimates. T is the last extract's
token count when there is one, else every sample at full length (an upper bound). The pick:
offline when its store fits the node's disk less the margin; else hybrid with the largest cache the
node holds (``train.state_cache_gib: auto``); online only when no cache fits beside the tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from eagle3.config import PipelineConfig
from eagle3.plan_rates import (
    GIB,
    HOST_SHARE,
    Figure,
    Node,
    gib,
    manifest,
    plan_node,
    target_rate,
    train_rate,
)

TOKEN_BYTES = 9  # what a token-only extract keeps: an int64 id and a uint8 loss mask


def tokens_bound(cfg: PipelineConfig) -> int | None:
    """Tokens of every sample at full length (None without generate.num_samples): the generated
    samples (a generous 512-token prompt + max_tokens) and extract.dataset_answers' conversations
    (each cut at extract.max_seq_len)."""
    n = cfg.generate.num_samples
    if n is None:
        return None
    e = cfg.extract
    return n * min(cfg.generate.max_tokens + 512, e.max_seq_len) + e.dataset_answers * e.max_seq_len


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


def _dur(s: float) -> str:
    """Seconds as a person reads them: 45 s, 12 min, 3.4 h."""
    if s < 120:
        return f"{s:.0f} s"
    return f"{s / 60:,.0f} min" if s < 7200 else f"{s / 3600:,.1f} h"


def epoch_tokens(cfg: PipelineConfig) -> Figure:
    """T: the last extract's tokens (measured), else every sample at full length."""
    folder = cfg.paths.stage_dir("extract")
    m = manifest(folder)
    if m and m.get("tokens"):
        return Figure(m["tokens"], f"measured: {m.get('samples')} samples in {folder}")
    bound = tokens_bound(cfg)
    if bound is None:
        return Figure(None, "unknown: generate.num_samples unset")
    return Figure(bound, "every sample at full length (an upper bound)")


def auto_cache_bytes(cfg: PipelineConfig, node: Node, tokens: float) -> float:
    """``train.state_cache_gib: auto`` on ``node``: every state, as far as half the host memory
    and the disk left after the tokens (less the margin) hold them."""
    states = tokens * state_bytes_per_token(cfg)
    room = HOST_SHARE * node.memory + max(0.0, node.room - tokens * TOKEN_BYTES)
    return max(0.0, min(states, room))


def profile_layout(cfg: PipelineConfig) -> str:
    """The layout the profile asks for: extract.states and train.state_cache_gib."""
    if cfg.extract.states == "offline":
        return "offline"
    return "online" if cfg.train.state_cache_gib == 0 else "hybrid"


@dataclass
class Layout:
    """One layout's price (seconds; None where a rate is unknown)."""

    name: str
    disk: float  # bytes on the node's disk
    cache: float = 0.0  # bytes of states kept for later epochs (hybrid)
    memory: float = 0.0  # ... of which in host memory
    share: float = 0.0  # share of the states read back after epoch 1
    target_s: float | None = None  # the target's time in all
    target_epoch_s: tuple[float, float] | None = None  # epoch 1, each later epoch
    train_s: float | None = None  # the trainer's time in all
    total_s: float | None = None
    serial_s: float | None = None  # online/hybrid vLLM: the total if nothing overlapped


def price(
    cfg: PipelineConfig,
    name: str,
    tokens: float,
    rt: float | None,
    rd: float | None,
    cache: float = 0.0,
    node: Node | None = None,
) -> Layout:
    """The formulas of the module docstring for one layout."""
    e = cfg.train.epochs
    states = tokens * state_bytes_per_token(cfg)
    if name == "offline":
        lay = Layout(name, states, states, share=1.0)
        if rt and rd:
            lay.target_s, lay.train_s = tokens / rt, e * tokens / rd
            lay.total_s = lay.target_s + lay.train_s
        return lay
    cache = min(cache, states)
    memory = min(cache, HOST_SHARE * node.memory) if node else 0.0
    lay = Layout(name, tokens * TOKEN_BYTES + cache - memory, cache, memory, cache / states)
    if rt and rd:
        first, later, step = tokens / rt, (1 - lay.share) * tokens / rt, tokens / rd
        lay.target_epoch_s = (first, later)
        lay.target_s, lay.train_s = first + (e - 1) * later, e * step
        lay.serial_s = lay.target_s + lay.train_s
        lay.total_s = (
            max(first, step) + (e - 1) * max(later, step)
            if cfg.extract.backend == "vllm"
            else lay.serial_s
        )
    return lay


def summary(lay: Layout, backend: str, epochs: int) -> str:
    """One line: disk, the target's and the trainer's hours, the total."""
    if lay.name == "offline":
        disk = f"disk {gib(lay.disk)} of states"
    else:
        disk = f"disk {gib(lay.disk)}" + (
            f" (tokens + {gib(lay.cache - lay.memory)} of cache; {gib(lay.memory)} more in "
            f"host memory), {lay.share:.1%} of the states cached"
            if lay.cache
            else " (tokens)"
        )
    if lay.total_s is None:
        return disk + "; hours unknown (a rate is missing)"
    if lay.name == "offline":
        target = f"target {_dur(lay.target_s)} once (extract)"
    else:
        first, later = lay.target_epoch_s
        target = f"target {_dur(first)} in epoch 1, {_dur(later)} each later, {_dur(lay.target_s)}"
    train = f"train {_dur(lay.train_s / epochs)} an epoch, {_dur(lay.train_s)}"
    total = f"total {_dur(lay.total_s)}"
    if lay.name != "offline" and backend == "vllm":
        total += f" (overlapped; {_dur(lay.serial_s)} if not)"
    return f"{disk}; {target}; {train}; {total}"


#: a cache that holds less than this share of the states is not worth its disk: online
MIN_SHARE = 0.01


def pick(cfg: PipelineConfig, lays: dict[str, Layout], node: Node, auto: Layout) -> tuple[str, str]:
    """(layout, why): offline when its store fits the node's disk less the margin; else hybrid
    with the largest cache the node holds (``auto``); online only when no cache fits."""
    off, fastest = lays["offline"], ""
    timed = {k: v.total_s for k, v in lays.items() if v.total_s is not None}
    if len(timed) == len(lays):
        best = min(timed, key=timed.get)
        fastest = (
            "; it is also the fastest"
            if best == "offline"
            else f"; {best} is estimated faster ({_dur(timed[best])} against "
            f"{_dur(timed['offline'])}) but holds the target's GPUs through training"
        )
    if off.disk <= node.room:
        return "offline", (
            f"its {gib(off.disk)} of states fit the node's {gib(node.room)} (free disk less "
            "the margin): the target runs once and each stage has every GPU" + fastest
        )
    tokens_disk = lays["online"].disk
    if auto.share >= MIN_SHARE and tokens_disk <= node.room:
        on = lays["online"]
        saved = ""
        if on.total_s is not None and auto.total_s is not None:
            same = _dur(on.total_s) == _dur(auto.total_s)
            saved = (
                f"; the target's time falls from {_dur(on.target_s)} (online) to "
                f"{_dur(auto.target_s)}, "
                + (
                    f"the total stays {_dur(auto.total_s)} (the trainer sets it)"
                    if same
                    else f"the total from {_dur(on.total_s)} to {_dur(auto.total_s)}"
                )
            )
        return "hybrid", (
            f"offline's {gib(off.disk)} exceed the node's {gib(node.room)} (free disk less the "
            f"margin); the largest cache the node holds, {gib(auto.cache)} (half the host memory "
            f"+ the disk left after the tokens), keeps {auto.share:.1%} of the states, so later "
            + ("epochs read only the cache" if auto.share >= 1 else "epochs recompute the rest")
            + " (extract.states: online, train.state_cache_gib: auto)"
            + saved
        )
    if tokens_disk > node.room:
        return "online", (
            f"not even the token ids ({gib(tokens_disk)}) fit the node's {gib(node.room)} (free "
            "disk less the margin): free disk first"
        )
    return "online", (
        f"neither offline's {gib(off.disk)} nor a cache of {MIN_SHARE:.0%} of the states fit "
        f"beside the tokens in the node's {gib(node.room)}: every epoch recomputes every state"
    )


def _details(cfg: PipelineConfig, target_conf: dict[str, Any] | None, trainable: int | None):
    """What each layout does and where its GPUs go (text for the plan, not priced)."""
    e, s, tc = cfg.extract, cfg.serve, cfg.train
    source = (
        "the target's vLLM extract server (started by train, the extract settings)"
        if e.backend == "vllm"
        else "the target loaded in the training process (transformers)"
    )
    offline = {
        "what": f"extract ({e.backend}) stores every token's states "
        f"({state_bytes_per_token(cfg):,} B a token, {e.storage_dtype}); train reads them back",
        "gpus": "extract, then train: each stage has every GPU to itself",
    }
    online = {
        "what": f"extract stores token ids and loss masks ({TOKEN_BYTES} B a token); train asks "
        f"{source} for each batch, {tc.online_prefetch} batches ahead",
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
                "(extract.online_gpu_memory_utilization): the overlapped hours assume they do "
                "not slow each other"
                if e.online_server_gpus is None
                else "the GPUs the server does not use (CUDA_VISIBLE_DEVICES of train)"
            )
        )
        if tc.nproc_per_node > 1:
            online["note"] = (
                f"one server for the {tc.nproc_per_node} ranks: rank 0 starts it, the others "
                "attach; each rank asks for its own batches ahead of its step"
            )
    else:
        online["gpus"] = "the target (its weights and a forward) shares the training GPU"
    flops = target_flops_per_token(target_conf)
    if flops:
        cost = f"the target's forward, ~{flops / 1e9:,.1f} GFLOP a token, every epoch ({tc.epochs})"
        if trainable:
            from eagle3.train.ttt import loss_offsets

            passes = len(loss_offsets(tc.ttt_steps, tc.parallel_depths))  # + parallel depths
            draft = 6.0 * trainable * passes
            cost += (
                f" beside the draft's ~{draft / 1e9:,.1f} GFLOP a token a step "
                f"(6 x trainable x {passes} passes)"
            )
        online["cost"] = cost
    return offline, online


def states_plan(
    cfg: PipelineConfig,
    target_conf: dict[str, Any] | None,
    draft_trainable: int | None,
    node: Node | None = None,
) -> dict[str, Any]:
    """The three layouts priced for the profile, the pick and why, and a warning where the
    profile asks for another layout (see the module docstring for the formulas)."""
    tc = cfg.train
    node = node or plan_node(cfg)
    tokens, rt, rd = epoch_tokens(cfg), target_rate(cfg), train_rate(cfg)
    out: dict[str, Any] = {
        "profile": f"{profile_layout(cfg)} (extract.states {cfg.extract.states}, "
        f"train.state_cache_gib {tc.state_cache_gib})",
        "basis": {
            "tokens an epoch": f"{tokens.value:,.0f}, {tokens.source}; {tc.epochs} epochs"
            if tokens.value
            else tokens.source,
            "target": f"{rt.value:,.0f} tokens/s ({rt.source})" if rt.value else rt.source,
            "train": f"{rd.value:,.0f} tokens/s ({rd.source})" if rd.value else rd.source,
            "node": node.source,
        },
    }
    offline, online = _details(cfg, target_conf, draft_trainable)
    if not tokens.value:
        out["offline"], out["online"] = offline, online
        return out
    t = tokens.value
    auto = price(cfg, "hybrid", t, rt.value, rd.value, auto_cache_bytes(cfg, node, t), node)
    numeric = not isinstance(tc.state_cache_gib, str) and tc.state_cache_gib > 0
    hybrid = (
        price(cfg, "hybrid", t, rt.value, rd.value, tc.state_cache_gib * GIB, node)
        if numeric
        else auto
    )
    lays = {
        "offline": price(cfg, "offline", t, rt.value, rd.value),
        "online": price(cfg, "online", t, rt.value, rd.value, 0.0, node),
        "hybrid": hybrid,
    }
    budget = f"train.state_cache_gib {tc.state_cache_gib:g}" if numeric else "auto"
    out["layouts"] = {
        "offline": summary(lays["offline"], cfg.extract.backend, tc.epochs),
        "online": summary(lays["online"], cfg.extract.backend, tc.epochs),
        f"hybrid ({budget})": summary(hybrid, cfg.extract.backend, tc.epochs),
    }
    chosen, why = pick(cfg, lays, node, auto)
    out["pick"] = f"{chosen}: {why}"
    if chosen == "hybrid" and hybrid.cache < auto.cache:
        out["note"] = (
            f"the profile's cache keeps {hybrid.share:.1%} of the states; auto would keep "
            f"{auto.share:.1%} on this node"
        )
    if chosen != profile_layout(cfg):
        out["warning"] = f"the profile asks for {out['profile']}; the plan picks {chosen}"
    out["offline"], out["online"] = offline, online
    return out


def layout_pick(cfg: PipelineConfig, node: Node | None = None) -> str | None:
    """The layout the plan picks on ``node`` (default: this machine, measured), or None without
    a token count: what ``eagle3 preflight`` compares the profile's layout with."""
    tokens = epoch_tokens(cfg).value
    if not tokens:
        return None
    node = node or plan_node(cfg, measure=True)
    lays = {k: price(cfg, k, tokens, None, None, 0.0, node) for k in ("offline", "online")}
    auto = price(cfg, "hybrid", tokens, None, None, auto_cache_bytes(cfg, node, tokens), node)
    return pick(cfg, {**lays, "hybrid": auto}, node, auto)[0]
