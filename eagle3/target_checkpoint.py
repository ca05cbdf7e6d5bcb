"""Reading single tensors out of the target's safetensors checkpoint, without loading the target.

The train stage needs three of the target's tensors: the input embedding (the draft's frozen
``embed_tokens``), the final norm and the lm_head (the target distribution, and the optional
warm start of the draft's read-out). A 1T-parameter checkpoint costs one tensor's bytes each:
only the shard that holds a tensor is opened, and safetensors memory-maps it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch

#: Where Llama-style and multimodal-wrapped (Kimi-K2.5: ``language_model.``) checkpoints keep them.
EMBED_NAMES = (
    "model.embed_tokens.weight",
    "language_model.model.embed_tokens.weight",
    "model.language_model.embed_tokens.weight",
    "embed_tokens.weight",
)
LM_HEAD_NAMES = (
    "lm_head.weight",
    "language_model.lm_head.weight",
    "model.lm_head.weight",
)
NORM_NAMES = (
    "model.norm.weight",
    "language_model.model.norm.weight",
    "model.language_model.norm.weight",
    "norm.weight",
)


def checkpoint_dir(model: str | Path) -> Path:
    """The local folder of the target's checkpoint: ``model`` itself, or a hub id's snapshot in the
    local Hugging Face cache (where vLLM put it when it first served the target, with the same
    ``HF_HOME``). Never downloads: the stages that read the checkpoint (train reads the embedding,
    final norm and lm_head) must not fetch a 1T-parameter model as a side effect.

    Raises:
        FileNotFoundError: neither a folder nor a cached snapshot (the message says what to set).
    """
    path = Path(model)
    if path.is_dir():
        return path
    name = str(model)
    if not path.is_absolute() and name.count("/") == 1 and not name.startswith("."):
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError

        try:
            return Path(snapshot_download(name, local_files_only=True))
        except LocalEntryNotFoundError:
            raise FileNotFoundError(
                f"target {name}: not a local folder, and not in the local Hugging Face cache "
                f"({constants.HF_HUB_CACHE}). "
                "The serve stage's vLLM downloads it there on its first start "
                "(same HF_HOME); or set target.model to the checkpoint's folder"
            ) from None
    raise FileNotFoundError(f"target {name}: no such folder")


def _checkpoint_map(model_dir: Path) -> dict[str, str]:
    """tensor name -> file name (relative to model_dir), from the index or the single file."""
    from safetensors import safe_open

    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return dict(json.loads(index.read_text())["weight_map"])
    single = model_dir / "model.safetensors"
    if single.is_file():
        with safe_open(str(single), framework="pt") as f:
            return {k: single.name for k in f.keys()}
    raise FileNotFoundError(
        f"{model_dir}: neither model.safetensors.index.json nor model.safetensors"
    )


def load_target_tensor(model_dir: str | Path, names: str | Sequence[str]) -> torch.Tensor:
    """One tensor from the target's safetensors checkpoint, without loading the target.

    ``names`` is a name or candidate names tried in order; the first present is returned.
    With ``model.safetensors.index.json`` only the shard that holds the tensor is opened (and
    only that tensor read: safetensors memory-maps), so a 1T-parameter checkpoint costs one
    tensor's bytes. Without an index, ``model.safetensors`` is read the same way.

    Raises:
        KeyError: none of the names is in the checkpoint (the message lists what was tried).
    """
    from safetensors import safe_open

    model_dir = Path(model_dir)
    candidates = [names] if isinstance(names, str) else list(names)
    weight_map = _checkpoint_map(model_dir)
    for name in candidates:
        if name in weight_map:
            with safe_open(str(model_dir / weight_map[name]), framework="pt") as f:
                return f.get_tensor(name)
    raise KeyError(f"{model_dir}: none of {candidates} in the checkpoint")


def has_target_tensor(model_dir: str | Path, names: str | Sequence[str]) -> str | None:
    """The first of ``names`` present in the checkpoint, or None (reads only the index/header)."""
    weight_map = _checkpoint_map(Path(model_dir))
    for name in [names] if isinstance(names, str) else names:
        if name in weight_map:
            return name
    return None


def load_target_embeddings(model_dir: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(embed_tokens [V, H], lm_head [V, H]) of the target. Tied embeddings (no lm_head tensor,
    or ``tie_word_embeddings``) give the embedding for both (the same tensor object)."""
    model_dir = Path(model_dir)
    embed = load_target_tensor(model_dir, EMBED_NAMES)
    cfg_path = model_dir / "config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    tied = bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
    head_name = None if tied else has_target_tensor(model_dir, LM_HEAD_NAMES)
    head = embed if head_name is None else load_target_tensor(model_dir, head_name)
    return embed, head


__all__ = [
    "EMBED_NAMES",
    "LM_HEAD_NAMES",
    "NORM_NAMES",
    "checkpoint_dir",
    "has_target_tensor",
    "load_target_embeddings",
    "load_target_tensor",
]
