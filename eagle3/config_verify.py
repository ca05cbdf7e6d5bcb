"""The verify stage's profile section (eagle3/config_stages.py holds the other stages').

Its values key the verify stage's artifacts, except the fields marked ``UNKEYED``."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from eagle3.config_sections import UNKEYED, _Section


class VerifyConfig(_Section):
    """Baseline server vs speculative server on the same workload; the gate decides promotion."""

    num_speculative_tokens: int | list[int] = Field(
        3,
        description="k, the draft tokens proposed per step. A list (e.g. [1, 2, 3, 4, 5]) sweeps "
        "k for the draft and the n-gram baseline: tokens/s predicted for every k from one offline "
        "pass and few servers, the predicted best served, the best measured k promoted with the "
        "draft as its serving config (docs/verify.md, 'Which k').",
    )
    parallel_drafting: Literal["auto", "off"] = Field(
        "auto",
        description="A draft trained for parallel drafting (train.parallel_depths) is also "
        "served with vLLM's parallel_drafting at the ks of the sweep up to its trained depths, "
        "and the faster way (by measured tokens/s, per concurrency) goes into serving.json. "
        "off: sequential drafting only.",
    )
    sweep_servers: int = Field(
        3,
        ge=1,
        description="k sweep: speculative servers per method (draft, n-gram) at most: the largest "
        "and the smallest k first (they give the step time's line), then the predicted best k of "
        "each concurrency. 1: the largest k alone, the baseline as the line's other end.",
        json_schema_extra=UNKEYED,
    )
    sweep_measure_all: bool = Field(
        False,
        description="k sweep: also serve every other k (bench/verify_sweep.py: prediction vs "
        "measurement for all k).",
        json_schema_extra=UNKEYED,
    )
    mix_categories: bool = Field(
        True,
        description="With num_prompts, take the conversations round-robin over the workload's "
        "categories (MT-bench: writing, roleplay, ...), not the first N of the file (all writing).",
    )
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
    # The free baseline every draft must beat: prompt lookup, vLLM's {"method": "ngram"}
    # (docs/verify.md).
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
                "verify.speculative_unit needs verify.candidate_link "
                "(the draft path its unit serves)"
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

    @field_validator("num_speculative_tokens")
    @classmethod
    def _ks(cls, v: int | list[int]) -> int | list[int]:
        ks = [v] if isinstance(v, int) else v
        if not ks or any(k < 1 for k in ks) or len(set(ks)) != len(ks):
            raise ValueError(
                "verify.num_speculative_tokens must be a positive int or a list of distinct "
                "positive ints (a k sweep)"
            )
        return v if isinstance(v, int) else sorted(v)

    @property
    def ks(self) -> list[int]:
        """The ks to measure (one unless a sweep)."""
        v = self.num_speculative_tokens
        return [v] if isinstance(v, int) else list(v)

    @property
    def k(self) -> int:
        """The k a single server is configured with (the largest of a sweep: what a systemd
        unit or ``eagle3 plan`` shows before verify has chosen)."""
        return max(self.ks)

    def with_k(self, k: int) -> VerifyConfig:
        return self.model_copy(update={"num_speculative_tokens": k})
