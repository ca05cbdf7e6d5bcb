"""The hero-run flow under a Prefect test harness, against the session's real vLLM server
(attached through the external backend, so this test does not pay another server start)."""

import json

import pytest
from prefect.testing.utilities import prefect_test_harness

from flows.hero_run import hero_run
from tests.conftest import CPU_PROFILE

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def prefect_backend():
    with prefect_test_harness(server_startup_timeout=120):
        yield


def test_hero_run_flow(prefect_backend, vllm_server, tmp_path):
    summary = hero_run(
        config=str(CPU_PROFILE),
        overrides=["serve.backend=external", f"serve.base_url={vllm_server.base_url}", f"paths.runs_dir={tmp_path}",
                   "generate.num_samples=4", "generate.max_tokens=16", "train.epochs=1", "vocab.draft_vocab_size=256"],
    )
    assert summary["server"]["backend"] == "external" and not summary["server"]["started_here"]
    assert "paris" in summary["smoke_chat"]["content"].lower()
    assert summary["smoke_chat"]["completion_token_ids"]
    on_disk = json.loads((tmp_path / "smollm2-cpu" / "hero-run.json").read_text())
    assert on_disk == json.loads(json.dumps(summary))
    gen = summary["generate"]
    assert gen["totals"]["samples"] == 4 and gen["this_run"]["counts"]["generated"] == 4
    assert (tmp_path / "smollm2-cpu" / "generate" / "manifest.json").exists()
    assert summary["extract"]["samples"] == 4 and summary["extract"]["aux_layers"] == [2, 15, 27]
    assert 0 < summary["vocab"]["coverage"] <= 1
    assert (tmp_path / "smollm2-cpu" / "vocab" / "vocab.safetensors").exists()
    assert summary["train"]["steps"] >= 1
    assert (tmp_path / "smollm2-cpu" / "train" / "vllm-draft" / "config.json").exists()
    assert vllm_server.base_url  # the shared server is still there: external runs never stop it
