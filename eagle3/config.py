"""Pipeline configuration: one pydantic model per stage, loaded from a YAML profile.

A profile (``configs/*.yaml``) holds every stage's settings so that one file describes a
whole hero run. Any field can be overridden from the CLI with ``--set section.field=value``
(the value is parsed as YAML, so ``--set train.epochs=3`` gives an int and
``--set extract.aux_layers=[1,5,9]`` a list). Unknown fields are errors, not silently
ignored: a typo in a 1T-parameter run's profile must fail before any GPU time is spent.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, model_validator

from eagle3.config_sections import (
    EMBEDDED_PREFIX,
    UNKEYED,
    PathsConfig,
    PlanConfig,
    ServeConfig,
    TargetConfig,
    TrackingConfig,
    _Section,
    keys_stages,
)
from eagle3.config_stages import (
    ExtractConfig,
    GenerateConfig,
    TrainConfig,
    VocabConfig,
)
from eagle3.config_verify import VerifyConfig
from eagle3.errors import ConfigError

# The sections live in config_sections.py (setup, shared marks), config_stages.py and
# config_verify.py (one per stage); everything is importable from here as before.
__all__ = [
    "EMBEDDED_PREFIX",
    "UNKEYED",
    "ConfigError",
    "ExtractConfig",
    "GenerateConfig",
    "PathsConfig",
    "PipelineConfig",
    "PlanConfig",
    "ServeConfig",
    "TargetConfig",
    "TrackingConfig",
    "TrainConfig",
    "VerifyConfig",
    "VocabConfig",
    "apply_overrides",
    "config_from_dict",
    "keys_stages",
    "load_config",
    "parse_override",
]


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
    plan: PlanConfig = Field(default_factory=PlanConfig)  # eagle3 plan's estimates; keys nothing
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)  # TensorBoard; keys nothing

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
        """train.draft_arch resolved: "auto" is mla for DeepSeek/Kimi-family (MLA) targets,
        else llama."""
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
                f"; these are the default (2, N//2, N-3), which does not fit a {n}-layer target: "
                f"set extract.aux_layers to distinct layer ids in [0, {n}), e.g. {example}"
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
                f"vocab.draft_vocab_size {self.vocab.draft_vocab_size} exceeds "
                f"target.vocab_size {self.target.vocab_size}"
            )
        if (
            isinstance(self.generate.concurrency, int)
            and self.generate.concurrency > self.generate.concurrency_ceiling
        ):
            raise ValueError("generate.concurrency exceeds generate.concurrency_ceiling")
        return self


class _Yaml12Loader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2's booleans: only true / false (any case).

    Why: PyYAML reads YAML 1.1, where a bare on / off / yes / no / y / n is a boolean, so a
    profile's ``data_on_device: on`` or ``-s train.prefetch=off`` reached the config as True /
    False and was refused by a field whose values are the words."""


_Yaml12Loader.yaml_implicit_resolvers = {
    first: [r for r in resolvers if r[0] != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Yaml12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


def read_yaml(text: str) -> Any:
    """A profile or an override value, read as YAML 1.2 (see :class:`_Yaml12Loader`)."""
    return yaml.load(text, Loader=_Yaml12Loader)  # noqa: S506 (a SafeLoader subclass)


def parse_override(text: str) -> tuple[list[str], Any]:
    """``'train.epochs=3'`` -> (['train', 'epochs'], 3). The value is read as YAML."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {text!r}: expected section.field=value")
    try:
        value = read_yaml(raw) if raw.strip() else ""
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
        data = read_yaml(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{path}: not valid YAML{where}: {getattr(e, 'problem', e)}") from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: a profile must be a YAML mapping of sections, got {type(data).__name__}"
        )
    return config_from_dict(data, source=str(path), overrides=overrides)
