"""Shared fixtures.

The real vLLM CPU server costs ~40 s to start, so one is started per test session
(``vllm_server``) and shared by every test that only needs a running target. Tests that
check starting and stopping themselves start their own.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
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
        pytest.fail(
            f"vLLM serving environment missing ({cfg.serve.vllm_python}): `make test` creates it"
        )


def spec_counters(base_url: str) -> dict[str, float]:
    """vLLM's spec-decode counters (``vllm:spec_decode_*_total``, summed over labels) from /metrics."""
    import re

    import httpx

    totals: dict[str, float] = {}
    for line in httpx.get(f"{base_url}/metrics", timeout=30).text.splitlines():
        mt = re.match(r"^(vllm:spec_decode_[a-z_]+_total)(\{[^}]*\})?\s+([0-9.eE+-]+)$", line)
        if mt and "per_pos" not in mt.group(1):
            totals[mt.group(1)] = totals.get(mt.group(1), 0.0) + float(mt.group(3))
    return totals


@pytest.fixture(scope="session")
def vllm_server(cpu_cfg, smol_model, tmp_path_factory):
    """A REAL vLLM CPU server with SmolLM2, shared by the whole test session."""
    from eagle3.serving.server import start_server

    require_vllm(cpu_cfg)
    with start_server(
        cpu_cfg, str(smol_model), log_dir=tmp_path_factory.mktemp("vllm-logs")
    ) as server:
        yield server


@pytest.fixture
def scripted():
    """TEST DOUBLE for what vLLM cannot be made to do (answer 429/5xx on cue, a 200 that is not JSON,
    token ids that are not its tokenizer's): start tests/fakes/scripted_server.py with a status script."""
    import subprocess

    from eagle3.serving.readiness import free_port

    procs = []

    def start(statuses: str) -> str:
        port = free_port()
        proc = subprocess.Popen(
            [sys.executable, str(FAKES / "scripted_server.py"), str(port), statuses],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout.readline().strip() == "ready"
        procs.append(proc)
        return f"http://127.0.0.1:{port}"

    yield start
    for p in procs:
        p.kill()
        p.wait()


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
    with start_server(
        cfg, str(think_model), log_dir=tmp_path_factory.mktemp("vllm-think-logs")
    ) as server:
        yield server


SPEC_AUX = [2, 15, 27]  # SmolLM2's default auxiliary layers (2, N//2, N-3)


class SpeculatorsServer:
    """SmolLM2 served in the speculators format: ``vllm serve DRAFT`` with a RANDOM-weight draft
    (4096-row vocabulary) whose config names SmolLM2 as its verifier, 3 speculative tokens. A real
    target server (SmolLM2's ids, the profile's served name; greedy answers are the target's).

    One start serves two tests: tests/test_draft_model.py checks that vLLM serves the format
    (``get``), then tests/test_generate_vllm.py's server-death test takes it over (``take``) and
    kills it mid-generate. Either order works: a server is started whenever none is held."""

    def __init__(self, smol_model: Path, work: Path):
        self.smol_model, self.work = smol_model, work
        self.server = None
        self.draft: Path | None = None
        self.starts = 0

    def _export(self) -> Path:
        import torch

        from eagle3.draft import build_draft
        from eagle3.draft.export import export_speculators
        from eagle3.vocab import build_vocab

        torch.manual_seed(5)
        counts = torch.zeros(49152, dtype=torch.int64)
        ids = torch.randint(0, 49152, (20000,))
        counts.index_add_(0, ids, torch.ones_like(ids))
        counts[:300] += 100  # the low ids (special tokens, ASCII) always in
        vocab = build_vocab(counts, 4096)
        model = build_draft(self.smol_model, 4096, SPEC_AUX)
        return export_speculators(
            model,
            model.config,
            vocab.d2t,
            vocab.t2d,
            self.work / "draft-spec",
            verifier=str(self.smol_model),
            num_speculative_tokens=3,
        )

    def get(self):
        """The live server (started if none is held)."""
        if self.server is None:
            from eagle3.config import load_config
            from eagle3.serving.server import start_server

            cfg = load_config(CPU_PROFILE, ["serve.port=0"])
            require_vllm(cfg)
            self.draft = self.draft or self._export()
            self.starts += 1
            self.server = start_server(
                cfg, str(self.draft), log_dir=self.work / f"logs-{self.starts}"
            )
        return self.server

    def take(self):
        """The live server, handed over: the caller stops (or kills) it."""
        server, self.server = self.get(), None
        return server

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


@pytest.fixture(scope="session")
def speculators_server(smol_model, tmp_path_factory):
    holder = SpeculatorsServer(smol_model, tmp_path_factory.mktemp("speculators-server"))
    try:
        yield holder
    finally:
        holder.close()


def gen_cfg(tmp_path, *overrides):
    """The CPU profile, small and fast, writing under tmp_path."""
    from eagle3.config import load_config

    return load_config(
        CPU_PROFILE,
        [
            f"paths.runs_dir={tmp_path}",
            "generate.max_tokens=24",
            "generate.backoff_base_s=0.05",
            "generate.backoff_max_s=0.2",
            *overrides,
        ],
    )


GENERATED = Path(__file__).parent / "data" / "smollm2-generate"


@pytest.fixture(scope="session")
def gen_dir(tmp_path_factory) -> Path:
    """A small generate output: 8 real SmolLM2 samples (exact token ids from vLLM), checked in
    (tests/data/README.md), so extract, vocab and train tests need no server. A copy: stages write
    next to their inputs."""
    out = tmp_path_factory.mktemp("generated") / "generate"
    shutil.copytree(GENERATED, out)
    return out


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
    m = train(
        cfg, root / "extract", root / "vocab" / "vocab.safetensors", smol_model, root / "train"
    )
    assert m["complete"] and m["steps"] > 0
    return Path(m["export"])


SMOL_VLLM_AUX = [27, 2, 15]  # unsorted on purpose: vLLM returns them ascending


@dataclass
class VllmExtract:
    dir: Path
    manifest: dict
    elapsed_s: float  # the extract stage's wall time, its server's start included


@pytest.fixture(scope="session")
def smol_vllm_extract(gen_dir, smol_model, tmp_path_factory) -> VllmExtract:
    """The extract stage with the vLLM backend (one REAL vLLM server start) on the checked-in
    generate output, auxiliary layers ``SMOL_VLLM_AUX``: compared with transformers in
    tests/test_extract_vllm.py and trained on as the offline run in tests/test_online.py.
    Read only: tests that write work next to it, not in it."""
    import time

    from eagle3.extract.runner import extract

    root = tmp_path_factory.mktemp("smol-vllm-extract")
    cfg = gen_cfg(root, "extract.backend=vllm", f"extract.aux_layers={SMOL_VLLM_AUX}")
    require_vllm(cfg)
    t0 = time.monotonic()
    manifest = extract(cfg, gen_dir, root / "vllm", str(smol_model))
    return VllmExtract(root / "vllm", manifest, time.monotonic() - t0)


# ---------------------------------------------------------------------------
# The hero-run flow: one Prefect backend and one finished tiny hero run per session


TINY_STAGES = ["generate", "extract", "vocab", "train"]


@pytest.fixture(scope="session")
def prefect_backend():
    """A temporary Prefect server and database for the in-process flow tests."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@dataclass
class TinyHero:
    runs_dir: Path
    dataset: Path
    overrides: list[str]
    summary: dict

    def with_runs_dir(self, runs_dir: Path) -> list[str]:
        return [o for o in self.overrides if not o.startswith("paths.runs_dir=")] + [
            f"paths.runs_dir={runs_dir}"
        ]


def tiny_hero_overrides(runs_dir: Path, dataset: Path, base_url: str) -> list[str]:
    """The CPU profile shrunk to seconds per stage, against an external (already running) server."""
    return [
        "serve.backend=external",
        f"serve.base_url={base_url}",
        f"paths.runs_dir={runs_dir}",
        f"generate.dataset={dataset}",
        "generate.num_samples=null",
        "generate.max_tokens=16",
        "generate.concurrency=4",
        "train.epochs=1",
        "vocab.draft_vocab_size=256",
        "verify.workload=mt_bench",
        "verify.num_prompts=2",
        "verify.turns=1",
        "verify.max_tokens=16",
        "verify.concurrency=[1]",
        "verify.warmup_requests=0",
        "verify.offline_estimate=false",
        "verify.min_acceptance_length=1.0",
        "verify.num_speculative_tokens=2",  # one k: an external server serves one
    ]  # a 1-epoch draft on 4 samples barely beats 1


@pytest.fixture(scope="session")
def tiny_hero(prefect_backend, vllm_server, tmp_path_factory) -> TinyHero:
    """A finished hero run (generate .. train) of 4 prompts against the session's vLLM server.

    Tests that change its folder work on a copy (``TinyHero.with_runs_dir``): every stage of the
    copy is a cache hit, as the artifacts and Prefect's records travel together."""
    from flows.hero_run import HeroRunParams, hero_run

    root = tmp_path_factory.mktemp("tiny-hero")
    dataset = root / "prompts.jsonl"
    dataset.write_text(
        "".join((ROOT / "configs" / "data" / "demo-prompts.jsonl").read_text().splitlines(True)[:4])
    )
    overrides = tiny_hero_overrides(root / "runs", dataset, vllm_server.base_url)
    summary = hero_run(
        HeroRunParams(profile=str(CPU_PROFILE), overrides=overrides, stages=TINY_STAGES)
    )
    return TinyHero(root / "runs", dataset, overrides, summary)
