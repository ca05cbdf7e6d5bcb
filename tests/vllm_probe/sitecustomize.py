"""Test-only probe, imported at start-up by every Python process of a vLLM server started with
``PYTHONPATH=tests/vllm_probe`` and ``EAGLE3_DRAFT_PROBE_DIR`` set (tests/test_mla_draft.py).

It wraps vLLM's ``Eagle3DeepseekV2ForCausalLM`` (combine_hidden_states, forward, compute_logits)
when that module is imported, and, while the file ``<dir>/armed`` exists, saves each call's inputs
and outputs as ``<dir>/<pid>-<seq>-<kind>.safetensors``, so the test can replay exactly what the
served draft computed through the PyTorch draft. Nothing happens without the environment variable.
"""

import importlib.abc
import importlib.util
import os
import sys

_DIR = os.environ.get("EAGLE3_DRAFT_PROBE_DIR")
_MODULE = "vllm.model_executor.models.deepseek_eagle3"
_MAX_RECORDS = 200


def _patch(module) -> None:
    cls = module.Eagle3DeepseekV2ForCausalLM
    seq = [0]

    def save(kind: str, tensors: dict) -> None:
        if not os.path.exists(os.path.join(_DIR, "armed")) or seq[0] >= _MAX_RECORDS:
            return
        from safetensors.torch import save_file

        seq[0] += 1
        out = {
            k: v.detach().to("cpu").contiguous().clone()
            for k, v in tensors.items()
            if v is not None
        }
        final = os.path.join(_DIR, f"{os.getpid()}-{seq[0]:04d}-{kind}.safetensors")
        save_file(out, final + ".tmp")
        os.replace(final + ".tmp", final)

    combine, forward, logits = cls.combine_hidden_states, cls.forward, cls.compute_logits

    def combine_hidden_states(self, hidden_states):
        out = combine(self, hidden_states)
        save("combine", {"aux": hidden_states, "fc": out})
        return out

    def forward_(self, input_ids, positions, hidden_states, inputs_embeds=None):
        normed, prenorm = forward(self, input_ids, positions, hidden_states, inputs_embeds)
        save(
            "forward",
            {
                "input_ids": input_ids,
                "positions": positions,
                "hidden_states": hidden_states,
                "normed": normed,
                "prenorm": prenorm,
            },
        )
        return normed, prenorm

    def compute_logits(self, hidden_states):
        out = logits(self, hidden_states)
        save("logits", {"hidden_states": hidden_states, "logits": out})
        return out

    cls.combine_hidden_states, cls.forward, cls.compute_logits = (
        combine_hidden_states,
        forward_,
        compute_logits,
    )


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


if _DIR:
    sys.meta_path.insert(0, _Finder())
