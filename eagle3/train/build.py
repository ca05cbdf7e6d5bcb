"""The draft the train stage builds: :func:`build_model` (from the seed, checked against the vocab
and the extract, its read-out optionally started from the target's and frozen)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

from eagle3.draft import DraftModel, build_draft, draft_arch
from eagle3.extract.storage import HiddenStateDataset
from eagle3.train.target import init_head_from_target
from eagle3.vocab import VocabMapping


def draft_overrides(cfg: Any) -> dict[str, Any]:
    """The profile's changes to the draft config its target implies (``from_target``'s keywords).

    One function for train (:func:`build_model`) and ``eagle3 plan`` (eagle3/plan.py), so the plan
    describes the draft train builds: a second copy had lost ``norm_before_residual`` (issue 38).
    Unset fields are left out, so the target's own value (or the config's default) stands."""
    tc = cfg.train
    if tc.parallel_depths and not draft_arch(cfg.draft_arch).parallel_drafting:
        raise ValueError(
            f"train.parallel_depths {tc.parallel_depths}: vLLM 0.32 serves parallel drafting for "
            f"Llama and Qwen3 EAGLE-3 drafts only (its {cfg.draft_arch} draft has no mask_hidden): "
            "set train.parallel_depths=0 (docs/train.md, Parallel drafting)"
        )
    if tc.draft_num_layers > 1 and not draft_arch(cfg.draft_arch).multi_layer:
        raise ValueError(
            f"train.draft_num_layers {tc.draft_num_layers}: the {cfg.draft_arch} draft has one "
            "decoder layer here (vLLM's Llama EAGLE-3 draft takes several): set "
            "train.draft_num_layers=1"
        )
    return {
        k: v
        for k, v in {
            "num_attention_heads": tc.draft_num_attention_heads,
            "num_key_value_heads": tc.draft_num_key_value_heads,
            "intermediate_size": tc.draft_intermediate_size,
            "norm_before_residual": tc.norm_before_residual or None,
            "parallel_depths": tc.parallel_depths or None,
            "parallel_token_id": tc.parallel_token_id if tc.parallel_depths else None,
            "num_layers": tc.draft_num_layers if tc.draft_num_layers > 1 else None,
        }.items()
        if v is not None
    }


def draft_config(cfg: Any, target_config: dict[str, Any] | str | Path) -> Any:
    """The draft config train would build for ``target_config`` (a config.json as a dict, a file
    or a folder), without weights: what ``eagle3 plan`` prints."""
    spec = draft_arch(cfg.draft_arch)
    return spec.config_cls.from_target(
        target_config, cfg.vocab.draft_vocab_size, list(cfg.aux_layers), **draft_overrides(cfg)
    )


def build_model(
    cfg: Any, target_dir: Path, vocab: VocabMapping, ds: HiddenStateDataset
) -> DraftModel:
    """The draft of ``train.draft_arch`` from the seed, checked against the vocab and the stored
    states, its read-out optionally started from the target's and frozen."""
    tc = cfg.train
    torch.manual_seed(tc.seed)
    random.seed(tc.seed)
    aux_layers = list(cfg.aux_layers)
    model = build_draft(
        target_dir, vocab.draft_vocab_size, aux_layers, arch=cfg.draft_arch, **draft_overrides(cfg)
    )
    dcfg = model.config
    if vocab.target_vocab_size != dcfg.vocab_size:
        raise ValueError(
            f"vocab built for {vocab.target_vocab_size} target ids, target has {dcfg.vocab_size}"
        )
    if ds.aux_width is not None and ds.aux_width != dcfg.fc_input_size:
        raise ValueError(
            f"stored aux width {ds.aux_width} != {len(aux_layers)} x {dcfg.target_hidden_size}"
        )
    if tc.head_init != "random":
        init_head_from_target(model, target_dir, vocab.draft_ids, norm=tc.head_init == "target")
    if tc.freeze_head:  # target_lm_head: the final norm (started at 1) still trains
        norm = () if tc.head_init == "target_lm_head" else tuple(model.norm.parameters())
        for prm in (*model.lm_head.parameters(), *norm):
            prm.requires_grad_(False)
    return model
