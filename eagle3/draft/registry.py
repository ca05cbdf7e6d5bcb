"""The draft architectures, one entry each: the one place the draft type is dispatched on.

``train.draft_arch`` names an entry; an entry says how to build the draft (config class, module
class), how vLLM knows it (architecture names, the layer fields of its ``config.json``) and what
its checkpoint holds (name -> shape of every exported weight: the export's names are the
module's parameter names, so this table is the weight-name mapping). Adding an architecture is
one module in this package plus one entry here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eagle3.draft import llama, mla
from eagle3.draft.common import DraftModel


@dataclass(frozen=True)
class DraftArch:
    """One draft architecture."""

    name: str  # the value of train.draft_arch
    # dataclass with from_target(target_config, draft_vocab_size, aux_layer_ids, **overrides)
    config_cls: type
    module_cls: type[DraftModel]
    vllm_architectures: tuple[
        str, ...
    ]  # the first is what the export writes; all are recognised on load
    weight_shapes: Callable[
        [Any], dict[str, tuple[int, ...]]
    ]  # checkpoint name -> shape (trainable weights)
    vllm_fields: Callable[
        [Any, torch.dtype], dict[str, Any]
    ]  # the layer fields of the export's config.json
    config_from_export: Callable[[dict[str, Any]], Any]  # an export's config.json -> config
    check_export: Callable[[Any], None] = lambda cfg: (
        None
    )  # raises if vLLM could not load the export
    speculators_format: bool = False  # the speculators format can describe its layer
    # vLLM serves it with parallel_drafting (its model class loads mask_hidden: llama_eagle3.py
    # and qwen3_eagle3.py do, deepseek_eagle3.py does not in 0.32)
    parallel_drafting: bool = False
    # it takes train.draft_num_layers > 1 (llama_eagle3.py builds num_hidden_layers layers)
    multi_layer: bool = False

    @property
    def vllm_architecture(self) -> str:
        return self.vllm_architectures[0]


DRAFTS: dict[str, DraftArch] = {
    "llama": DraftArch(
        name="llama",
        config_cls=llama.DraftConfig,
        module_cls=llama.Eagle3Draft,
        vllm_architectures=("LlamaForCausalLMEagle3",),
        weight_shapes=llama.llama_weight_shapes,
        vllm_fields=llama.llama_fields,
        config_from_export=llama.config_from_export,
        speculators_format=True,
        parallel_drafting=True,
        multi_layer=True,
    ),
    "mla": DraftArch(
        name="mla",
        config_cls=mla.MLADraftConfig,
        module_cls=mla.Eagle3MLADraft,
        # deepseek_eagle3.py; Eagle3DeepseekV3ForCausalLM is an alias
        vllm_architectures=("Eagle3DeepseekV2ForCausalLM", "Eagle3DeepseekV3ForCausalLM"),
        weight_shapes=mla.mla_weight_shapes,
        vllm_fields=mla.mla_fields,
        config_from_export=mla.config_from_export,
        check_export=mla.check_vllm_loadable,
    ),
}
DRAFT_ARCHS = tuple(DRAFTS)


def draft_arch(name: str) -> DraftArch:
    """The entry of ``train.draft_arch`` (resolved: not "auto")."""
    if name not in DRAFTS:
        raise ValueError(f"unknown draft arch {name!r}; known: {DRAFT_ARCHS}")
    return DRAFTS[name]


def arch_of(cfg: Any) -> DraftArch:
    """The entry of a draft config (or of a draft: its ``config``)."""
    cfg = getattr(cfg, "config", cfg)
    for arch in DRAFTS.values():
        if type(cfg) is arch.config_cls:
            return arch
    raise TypeError(f"{type(cfg).__name__} is not a registered draft config")


def arch_of_export(architectures: Sequence[str]) -> DraftArch:
    """The entry whose vLLM architecture an export's ``config.json`` names (llama when none
    does)."""
    for arch in DRAFTS.values():
        if any(a in arch.vllm_architectures for a in architectures):
            return arch
    return DRAFTS["llama"]


def build_draft(
    target_dir: str | Path,
    draft_vocab_size: int,
    aux_layer_ids: Sequence[int],
    *,
    arch: str = "llama",
    load_embeddings: bool = True,
    **overrides: Any,
) -> DraftModel:
    """The draft's config from the target's config.json, a fresh draft, the target's embedding
    copied in.

    ``arch``: "llama" (vLLM's Eagle3LlamaForCausalLM) or "mla" (vLLM's Eagle3DeepseekV2ForCausalLM,
    for DeepSeek/Kimi-family targets)."""
    spec = draft_arch(arch)
    cfg = spec.config_cls.from_target(
        Path(target_dir), draft_vocab_size, aux_layer_ids, **overrides
    )
    model = spec.module_cls(cfg)
    if load_embeddings:
        model.load_embeddings(target_dir)
    return model
