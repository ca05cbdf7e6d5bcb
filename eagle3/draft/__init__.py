"""The EAGLE-3 draft: its architectures, their registry and the export vLLM serves.

- :mod:`eagle3.draft.common`: what every draft shares (RMSNorm, MLP, masked attention over a KV
  prefix, the decoder layer, :class:`DraftModel` with the forward).
- :mod:`eagle3.draft.llama`: vLLM's ``Eagle3LlamaForCausalLM`` (GQA, rotate-half RoPE).
- :mod:`eagle3.draft.mla`: vLLM's ``Eagle3DeepseekV2ForCausalLM`` (MLA, interleaved YaRN RoPE).
- :mod:`eagle3.draft.registry`: one :class:`DraftArch` entry per architecture, the one dispatch
  point.
- :mod:`eagle3.draft.export`: the vLLM and speculators checkpoint formats, and reading them back.
"""

from eagle3.draft.common import DraftModel
from eagle3.draft.llama import DraftConfig, Eagle3Draft
from eagle3.draft.mla import Eagle3MLADraft, MLADraftConfig
from eagle3.draft.registry import DRAFT_ARCHS, DRAFTS, DraftArch, arch_of, build_draft, draft_arch

__all__ = [
    "DRAFTS",
    "DRAFT_ARCHS",
    "DraftArch",
    "DraftConfig",
    "DraftModel",
    "Eagle3Draft",
    "Eagle3MLADraft",
    "MLADraftConfig",
    "arch_of",
    "build_draft",
    "draft_arch",
]
