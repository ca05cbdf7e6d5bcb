"""Shared fixtures.

The real vLLM CPU server costs ~40 s to start, so one is started per test session
(``vllm_server``) and shared by every test that only needs a running target. Tests that
check starting and stopping themselves start their own.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CPU_PROFILE = ROOT / "configs" / "smollm2-cpu.yaml"
KIMI_PROFILE = ROOT / "configs" / "kimi-k25-hero.yaml"
FAKES = Path(__file__).parent / "fakes"
ARTIFACTS = ROOT / "test-artifacts"


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")


@pytest.fixture(scope="session")
def cpu_cfg():
    from eagle3.config import load_config

    return load_config(CPU_PROFILE)


@pytest.fixture(scope="session")
def smol_model(cpu_cfg) -> Path:
    """The embedded SmolLM2 converted to safetensors (cached across sessions by GGUF hash)."""
    from eagle3.embedded import prepare_model

    return prepare_model(cpu_cfg.paths.cache_dir, cpu_cfg.target.embedded_name)


def require_vllm(cfg) -> None:
    if not os.access(cfg.serve.vllm_python, os.X_OK):
        pytest.fail(f"vLLM serving environment missing ({cfg.serve.vllm_python}): `make test` creates it")


@pytest.fixture(scope="session")
def vllm_server(cpu_cfg, smol_model, tmp_path_factory):
    """A REAL vLLM CPU server with SmolLM2, shared by the whole test session."""
    from eagle3.serving.server import start_server

    require_vllm(cpu_cfg)
    with start_server(cpu_cfg, str(smol_model), log_dir=tmp_path_factory.mktemp("vllm-logs")) as server:
        yield server


@pytest.fixture
def fake_systemd(tmp_path, monkeypatch):
    """Put the stand-in systemctl/journalctl first on PATH (no systemd runs here)."""
    state = tmp_path / "systemd"
    state.mkdir()
    monkeypatch.setenv("FAKE_SYSTEMD_DIR", str(state))
    monkeypatch.setenv("PATH", f"{FAKES}{os.pathsep}{os.environ['PATH']}")
    return state


def stub_argv(port: int, model: str, *extra: str) -> list[str]:
    return [sys.executable, str(FAKES / "openai_stub.py"), str(port), model, *extra]


@pytest.fixture(scope="session")
def think_model(smol_model, tmp_path_factory) -> Path:
    """SmolLM2 with a template that opens a <think> block (see eagle3.embedded.make_thinking_variant)."""
    from eagle3.embedded import make_thinking_variant

    return make_thinking_variant(smol_model, tmp_path_factory.mktemp("think") / "smollm2-think")


@pytest.fixture(scope="session")
def think_server(cpu_cfg, think_model, tmp_path_factory):
    """A REAL vLLM CPU server with the thinking variant and vLLM's deepseek_r1 reasoning parser."""
    from eagle3.config import load_config
    from eagle3.serving.server import start_server

    cfg = load_config(CPU_PROFILE, ["serve.reasoning_parser=deepseek_r1"])
    require_vllm(cfg)
    with start_server(cfg, str(think_model), log_dir=tmp_path_factory.mktemp("vllm-think-logs")) as server:
        yield server


def gen_cfg(tmp_path, *overrides):
    """The CPU profile, small and fast, writing under tmp_path."""
    from eagle3.config import load_config

    return load_config(CPU_PROFILE, [f"paths.runs_dir={tmp_path}", "generate.max_tokens=24",
                                     "generate.backoff_base_s=0.05", "generate.backoff_max_s=0.2", *overrides])


@pytest.fixture(scope="session")
def gen_dir(vllm_server, tmp_path_factory) -> Path:
    """A small generate output from the real server: 8 samples, shared by extract/vocab/train tests."""
    from eagle3.generate.runner import generate

    root = tmp_path_factory.mktemp("generated")
    cfg = gen_cfg(root, "generate.num_samples=8", "generate.max_tokens=40", "generate.concurrency=8")
    generate(cfg, [vllm_server.base_url], root / "generate")
    return root / "generate"


@pytest.fixture(scope="session")
def trained_draft(gen_dir, smol_model, tmp_path_factory) -> Path:
    """The train stage's own vLLM export, trained briefly on the real generated data (8 samples)."""
    from eagle3.extract.runner import extract
    from eagle3.train import train
    from eagle3.vocab import vocab_stage

    root = tmp_path_factory.mktemp("trained")
    cfg = gen_cfg(root, "train.epochs=2", "train.lr=1e-3", "train.token_budget=512")
    extract(cfg, gen_dir, root / "extract", str(smol_model))
    vocab_stage(root / "extract", root / "vocab", 49152, 512)
    m = train(cfg, root / "extract", root / "vocab" / "vocab.safetensors", smol_model, root / "train")
    assert m["complete"] and m["steps"] > 0
    return Path(m["export"])
