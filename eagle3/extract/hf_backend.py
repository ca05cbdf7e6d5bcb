"""Hidden states with transformers: the backend for targets that fit one machine.

- Only the base model runs (``AutoModel``: no lm_head, so no [T, vocab] logits are ever made).
- Forward hooks keep exactly what training needs: the INPUT of each auxiliary layer (vLLM's
  convention; equal to HF ``hidden_states[k]``) and the OUTPUT of the last layer before the
  final norm. ``output_hidden_states`` would keep all N+1 states (61 for Kimi) alive at once.
- Batches are length-bucketed under a token budget and right-padded: with causal attention
  the real positions never see the padding, so padded rows equal unpadded ones. So no attention
  mask is passed: with one, transformers builds a 4D mask and SDPA runs its masked path; without,
  its causal one, the same states 1.31x faster on an H100 (``bench/target_forward.py``).
- ``torch.inference_mode``, CUDA when present (bf16 there; float32 on CPU by default).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from eagle3.batching import token_budget_batches


def pick_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, dtype)


def decoder_layers(model: Any) -> torch.nn.ModuleList:
    for attr in ("layers", "h", "decoder.layers", "model.layers"):
        obj = model
        for part in attr.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if isinstance(obj, torch.nn.ModuleList):
            return obj
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__}")


def load_base_model(
    model_path: str, device: torch.device, dtype: torch.dtype, trust_remote_code: bool = False
):
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model_path, dtype=dtype, trust_remote_code=trust_remote_code)
    return model.to(device).eval()


class LayerTap:
    """Forward hooks that capture aux-layer inputs and the last layer's output."""

    def __init__(self, model: Any, aux_layers: list[int]):
        self.layers = decoder_layers(model)
        self.aux_layers = aux_layers
        self.captured: dict[str, torch.Tensor] = {}
        self.handles = []
        for k in aux_layers:
            self.handles.append(
                self.layers[k].register_forward_pre_hook(self._pre(k), with_kwargs=True)
            )
        self.handles.append(self.layers[-1].register_forward_hook(self._post, with_kwargs=True))

    def _pre(self, k: int):
        def hook(module, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            self.captured[f"aux{k}"] = x

        return hook

    def _post(self, module, args, kwargs, output):
        self.captured["final"] = output[0] if isinstance(output, tuple) else output

    def take(self) -> tuple[torch.Tensor, torch.Tensor]:
        aux = torch.cat([self.captured[f"aux{k}"] for k in self.aux_layers], dim=-1)
        final = self.captured["final"]
        self.captured = {}
        return aux, final

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


@torch.inference_mode()
def forward_states(
    model: Any,
    tap: LayerTap,
    seqs: list[list[int]],
    device: torch.device,
    pad_id: int = 0,
    to_host: bool = True,
    masked: bool = False,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One right-padded batch -> per sequence (aux [T, 3H], final [T, H]) on the CPU, or with
    ``to_host=False`` left on the device (the online states keep them there). ``masked`` passes
    the padding mask as well (the same states, slower on CUDA: only the bench sets it)."""
    longest = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), longest), pad_id, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
    extra = {}
    if masked:
        lens = torch.tensor([len(s) for s in seqs])
        extra["attention_mask"] = (torch.arange(longest)[None] < lens[:, None]).long().to(device)
    model(input_ids=ids.to(device), use_cache=False, **extra)
    aux, final = tap.take()
    if device.type == "cuda" and to_host:
        # one device-to-host copy per batch (not per sequence), into pinned memory: DMA at full
        # PCIe/NVLink speed instead of a staged pageable copy (GBs per batch for a large target)
        aux_h = torch.empty(aux.shape, dtype=aux.dtype, pin_memory=True)
        final_h = torch.empty(final.shape, dtype=final.dtype, pin_memory=True)
        aux_h.copy_(aux, non_blocking=True)
        final_h.copy_(final, non_blocking=True)
        # this thread's stream only: the online states run this on the loader thread's stream
        # while a training step runs on another, which a device-wide sync would wait for
        torch.cuda.current_stream(device).synchronize()
        aux, final = aux_h, final_h
    return [(aux[i, : len(s)], final[i, : len(s)]) for i, s in enumerate(seqs)]


def chunks(items: Iterable[Any], n: int) -> Iterator[list[Any]]:
    chunk: list[Any] = []
    for x in items:
        chunk.append(x)
        if len(chunk) >= n:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def extract_hf(
    model_path: str,
    examples: Iterable[Any],
    aux_layers: list[int],
    token_budget: int,
    chunk_samples: int = 512,
    device: str = "auto",
    dtype: str = "auto",
    trust_remote_code: bool = False,
) -> Iterator[tuple[Any, torch.Tensor, torch.Tensor]]:
    """Yield (example, aux [T, 3H], final [T, H]) for each example.

    Examples are read ``chunk_samples`` at a time (memory stays bounded) and length-bucketed
    within a chunk, so they come back in a different order than they went in.
    """
    dev = pick_device(device)
    model = load_base_model(model_path, dev, pick_dtype(dtype, dev), trust_remote_code)
    tap = LayerTap(model, aux_layers)
    try:
        for chunk in chunks(examples, chunk_samples):
            for batch in token_budget_batches([len(e.input_ids) for e in chunk], token_budget):
                outs = forward_states(model, tap, [chunk[i].input_ids for i in batch], dev)
                for i, (aux, final) in zip(batch, outs):
                    yield chunk[i], aux, final
    finally:
        tap.remove()
