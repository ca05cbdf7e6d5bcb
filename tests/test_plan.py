"""`eagle3 plan` resolves a profile without running anything: how Kimi-K2.5 is tested here."""

import json

from typer.testing import CliRunner

from eagle3.cli import app
from tests.conftest import CPU_PROFILE, KIMI_PROFILE

runner = CliRunner()


def test_kimi_plan_json():
    r = runner.invoke(app, ["plan", "--config", str(KIMI_PROFILE), "--json"])
    assert r.exit_code == 0, r.output
    plan = json.loads(r.output)
    assert list(plan["stages"]) == ["serve", "generate", "extract", "vocab", "train", "verify"]
    server = plan["stages"]["serve"]["server"]
    assert server["start"] == "systemctl start vllm-kimi-k25-int4"
    assert server["unit_file"].endswith("deploy/systemd/vllm-kimi-k25-int4.service")
    assert "--tensor-parallel-size 8" in server["command"] and "--reasoning-parser kimi_k2" in server["command"]
    assert plan["stages"]["extract"]["aux_layers (vLLM convention: input of layer k = HF hidden_states[k])"] == [2, 30, 58]
    spec_cmd = plan["stages"]["verify"]["speculative server"]["command"]
    assert '"method":"eagle3"' in spec_cmd and '"num_speculative_tokens":3' in spec_cmd
    assert plan["stages"]["train"]["artifact"] == "/data/eagle3/runs/kimi-k25-hero/train"


def test_cpu_plan_text_with_override():
    r = runner.invoke(app, ["plan", "-c", str(CPU_PROFILE), "--set", "serve.port=8123"])
    assert r.exit_code == 0, r.output
    assert "Stages: prepare-model -> serve -> generate" in r.output
    assert "vllm.entrypoints.openai.api_server --model" in r.output and "--port 8123" in r.output
    assert "VLLM_CPU_KVCACHE_SPACE=2" in r.output


def test_plan_hides_api_key():
    r = runner.invoke(app, ["plan", "-c", str(CPU_PROFILE), "--set", "serve.api_key=sk-secret-123", "--json"])
    assert r.exit_code == 0 and "sk-secret-123" not in r.output


def test_plan_reports_config_errors():
    r = runner.invoke(app, ["plan", "-c", str(KIMI_PROFILE), "--set", "train.nope=1"])
    assert r.exit_code == 2 and "train.nope: unknown field" in r.output
