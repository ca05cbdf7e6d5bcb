"""`eagle3 plan` resolves a profile without running anything: how Kimi-K2.5 is tested here."""

import json

import pytest
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
    assert (
        "--tensor-parallel-size 8" in server["command"]
        and "--reasoning-parser kimi_k2" in server["command"]
    )
    assert plan["stages"]["extract"][
        "aux_layers (vLLM convention: input of layer k = HF hidden_states[k])"
    ] == [2, 30, 58]
    # extract (vllm backend) runs its own vLLM process: the unit's command plus the connector
    ext = plan["stages"]["extract"]["server"]
    assert ext["backend"] == "process" and ext["command"].startswith("PYTHONPATH=")
    assert (
        "/opt/vllm/bin/vllm serve moonshotai/Kimi-K2.5" in ext["command"]
        and "--tensor-parallel-size 8" in ext["command"]
    )
    assert (
        '"kv_connector":"Eagle3HiddenStatesConnector"' in ext["command"]
        and "[2,30,58]" in ext["command"]
    )
    assert "needs systemd unit vllm-kimi-k25-int4 stopped" in ext["gpus"]
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
    r = runner.invoke(
        app, ["plan", "-c", str(CPU_PROFILE), "--set", "serve.api_key=sk-secret-123", "--json"]
    )
    assert r.exit_code == 0 and "sk-secret-123" not in r.output


def test_plan_reports_config_errors():
    r = runner.invoke(app, ["plan", "-c", str(KIMI_PROFILE), "--set", "train.nope=1"])
    assert r.exit_code == 2 and "train.nope: unknown field" in r.output


def test_a_second_draft_layer_is_refused_for_the_mla_draft():
    """vLLM's Llama EAGLE-3 draft takes num_hidden_layers layers; ours of MLA has one: the plan
    says so where it sizes the draft (train's build_model raises the same ValueError)."""
    from eagle3.config import load_config
    from eagle3.train.build import draft_overrides

    r = runner.invoke(
        app, ["plan", "-c", str(KIMI_PROFILE), "--set", "train.draft_num_layers=2", "--json"]
    )
    assert r.exit_code == 0, r.output
    err = json.loads(r.output)["stages"]["train"]["draft"]["error"]
    assert err.startswith("cannot size the draft: train.draft_num_layers 2: the mla draft has one")
    cfg = load_config(KIMI_PROFILE, ["train.draft_num_layers=2"])
    with pytest.raises(ValueError, match="set train.draft_num_layers=1"):
        draft_overrides(cfg)


def test_kimi_plan_shows_the_mla_draft():
    """The Kimi profile's plan: the MLA draft's resolved config, every weight's shape, parameter counts
    (Kimi-K2.5's sizes from configs/targets/moonshotai--Kimi-K2.5.json: no checkpoint here)."""
    r = runner.invoke(app, ["plan", "--config", str(KIMI_PROFILE), "--json"])
    assert r.exit_code == 0, r.output
    draft = json.loads(r.output)["stages"]["train"]["draft"]
    assert (
        draft["arch"].startswith("mla")
        and draft["vllm_architecture"] == "Eagle3DeepseekV2ForCausalLM"
    )
    assert draft["target_config"] == "configs/targets/moonshotai--Kimi-K2.5.json"
    c = draft["config"]
    assert (
        c["hidden_size"],
        c["num_attention_heads"],
        c["q_lora_rank"],
        c["kv_lora_rank"],
        c["qk_nope_head_dim"],
        c["qk_rope_head_dim"],
        c["v_head_dim"],
        c["intermediate_size"],
    ) == (7168, 64, 1536, 512, 128, 64, 128, 18432)
    assert c["rope_scaling"]["rope_type"] == "yarn" and c["rope_scaling"]["factor"] == 64.0
    assert c["aux_layer_ids"] == [2, 30, 58] and c["draft_vocab_size"] == 32000
    w = draft["weights (exported)"]
    assert (
        w["fc.weight"] == "7168 x 21504"
        and w["midlayer.self_attn.q_a_proj.weight"] == "1536 x 14336"
    )
    assert w["midlayer.self_attn.kv_a_proj_with_mqa.weight"] == "576 x 14336"
    assert (
        w["midlayer.self_attn.kv_b_proj.weight"] == "16384 x 512"
        and w["lm_head.weight"] == "32000 x 7168"
    )
    assert draft["parameters"]["trainable"] == 896_169_984
    assert draft["parameters"]["frozen embedding"] == 163840 * 7168
    assert "profile/config mismatches" not in draft
    text = runner.invoke(app, ["plan", "--config", str(KIMI_PROFILE)]).output
    assert "896.17 M trainable + 1.174 B frozen embedding = 2.071 B" in text
    assert "midlayer.self_attn.q_b_proj.weight: 12288 x 1536" in text


def test_plans_of_the_other_profiles_name_their_drafts():
    from tests.conftest import ROOT

    r = runner.invoke(app, ["plan", "-c", str(CPU_PROFILE), "--json"])
    draft = json.loads(r.output)["stages"]["train"]["draft"]
    assert (
        draft["vllm_architecture"] == "LlamaForCausalLMEagle3"
        and draft["arch"] == "llama (train.draft_arch: auto)"
    )
    r = runner.invoke(
        app, ["plan", "-c", str(ROOT / "configs" / "tiny-deepseek-cpu.yaml"), "--json"]
    )
    assert r.exit_code == 0, r.output
    draft = json.loads(r.output)["stages"]["train"]["draft"]
    assert draft["vllm_architecture"] == "Eagle3DeepseekV2ForCausalLM" and draft["config"][
        "aux_layer_ids"
    ] == [1, 3, 4]
    assert (
        draft["weights (exported)"]["midlayer.self_attn.kv_a_proj_with_mqa.weight"] == "576 x 512"
    )
    r = runner.invoke(
        app,
        [
            "plan",
            "-c",
            str(KIMI_PROFILE),
            "--set",
            "train.draft_arch=llama",
            "--set",
            "train.draft_num_key_value_heads=8",
            "--json",
        ],
    )
    draft = json.loads(r.output)["stages"]["train"]["draft"]
    assert (
        draft["weights (exported)"]["midlayer.self_attn.k_proj.weight"] == "896 x 14336"
    )  # 8 KV heads x 112


def test_preflight_of_the_kimi_profile_here_names_every_blocker(fake_systemd, tmp_path):
    """This machine is not a Kimi node: the checks must say exactly why, in seconds, starting nothing.
    (systemctl is the stand-in of tests/fakes: no systemd runs here.)"""
    from eagle3.config import load_config
    from eagle3.preflight import preflight

    cfg = load_config(KIMI_PROFILE, [f"paths.runs_dir={tmp_path}"])
    (fake_systemd / "vllm-kimi-k25-int4.cmd").write_text(
        "[]"
    )  # the serving unit is installed, the other not
    checks = {(c.name, c.detail.split(":")[0]): c for c in preflight(cfg)}
    status = {k: c.status for k, c in checks.items()}
    assert status[("vllm", "/opt/vllm/bin/vllm not found")] == "fail"
    assert status[("systemd", "vllm-kimi-k25-int4")] == "ok"
    assert "not installed" in checks[("systemd", "vllm-kimi-k25-int4-eagle3")].detail
    assert status[("systemd", "vllm-kimi-k25-int4-eagle3")] == "fail"
    assert (
        status[
            (
                "gpus",
                "0 visible, the profile needs 8 (serve.tensor_parallel_size 8, train.nproc_per_node 8)",
            )
        ]
        == "fail"
    )
    assert status[("target", "target moonshotai/Kimi-K2.5")] == "warn"  # vLLM downloads it at serve
    disk = next(c for c in checks.values() if c.name == "disk")
    # the profile is hybrid (extract.states online, state_cache_gib auto): the tokens (747 MiB),
    # not the 4,648 GiB offline would store, and the cache takes what the disk has free
    assert (
        "extract stores at most 747 MiB (10000 samples at full length, bfloat16, states hybrid: "
        "tokens + a cache of what the disk has free less the margin (auto))" in disk.detail
    )
    assert disk.status == "ok"
    assert "systemctl start" not in (fake_systemd / "calls.log").read_text()  # nothing started


@pytest.mark.vllm  # its pre-flight checks find the vLLM environment (.venv-vllm)
def test_dry_run_of_the_hero_run(capsys):

    from flows.hero_run import main

    out = main(
        ["--dry-run", "-c", str(CPU_PROFILE), "--stages", "train,verify", "--force", "verify"]
    )
    text = capsys.readouterr().out
    assert (
        "nothing is started" in text
        and "verify   recompute" in text
        and "generate use the latest artifact" in text
        and "extract  use the latest artifact" in text  # train reads it
    )
    assert "draft: llama" in text and all(c["status"] == "ok" for c in out["checks"]), text
    with pytest.raises(SystemExit, match="pre-flight check.* failed .*gpus"):
        main(["--dry-run", "-c", str(KIMI_PROFILE)])


def test_kimi_plan_shows_the_state_layouts_and_preflight_sizes_the_chosen_one():
    """Offline stores ~4.6 TB for the hero run; online keeps tokens (+ a cache: hybrid) and needs
    the target's GPUs while train runs (issues 29, 38; the prices: tests/test_plan_states.py)."""
    from eagle3.config import load_config
    from eagle3.plan import STATES_KEY
    from eagle3.preflight import extract_bytes_upper_bound

    r = runner.invoke(app, ["plan", "--config", str(KIMI_PROFILE), "--json"])
    states = json.loads(r.output)["stages"]["extract"][STATES_KEY]
    assert states["profile"].startswith("hybrid (extract.states online")
    assert states["layouts"]["offline"].startswith("disk 4,648.4 GiB of states")
    assert states["layouts"]["online"].startswith("disk 0.7 GiB (tokens)")
    on = states["online"]
    assert "tensor parallel 8" in on["gpus"] and "same GPUs" in on["gpus"]
    assert "GFLOP a token" in on["cost"] and "one server for the 8 ranks" in on["note"]
    off = extract_bytes_upper_bound(load_config(KIMI_PROFILE, ["extract.states=offline"]))
    online = extract_bytes_upper_bound(
        load_config(KIMI_PROFILE, ["extract.states=online", "train.state_cache_gib=2"])
    )
    assert off > 4000 * 1024**3 and online < 3 * 1024**3


def test_the_stages_own_modules_do_not_import_the_stage_contract():
    """eagle3/stages.py runs extract and generate; their modules key folders through eagle3.keys,
    never through the contract (the import circle issue 29 asked to break)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "eagle3"
    for mod in ("extract/runner.py", "generate/status.py", "keys.py"):
        assert "from eagle3.stages import" not in (root / mod).read_text(), mod


def _tiny_llama_target(folder):
    """A 4-layer Llama config.json and its embedding: all build_model reads of a target."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir()
    conf = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "num_hidden_layers": 4,
        "vocab_size": 256,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 512,
        "rope_theta": 10000.0,
    }
    (folder / "config.json").write_text(json.dumps(conf))
    save_file(
        {"model.embed_tokens.weight": torch.zeros(256, 64)}, str(folder / "model.safetensors")
    )
    return folder


@pytest.mark.parametrize("norm_before_residual,layers", [(True, 1), (False, 2)])
def test_plan_describes_the_draft_train_builds(tmp_path, norm_before_residual, layers):
    """`eagle3 plan` and train's build_model take the draft's settings from one function
    (eagle3.train.build.draft_overrides): the plan's config is the config train builds, with the
    profile's norm_before_residual, draft sizes and layers (issue 38: the plan's copy had lost
    norm_before_residual)."""
    from types import SimpleNamespace

    import torch

    from eagle3.config import load_config
    from eagle3.plan import draft_plan
    from eagle3.train.build import build_model
    from eagle3.vocab import build_vocab

    target = _tiny_llama_target(tmp_path / "target")
    cfg = load_config(
        CPU_PROFILE,
        [
            f"target.model={target}",
            "target.num_hidden_layers=4",
            "target.hidden_size=64",
            "target.vocab_size=256",
            "extract.aux_layers=[1,2,3]",
            "vocab.draft_vocab_size=32",
            f"train.norm_before_residual={str(norm_before_residual).lower()}",
            "train.draft_num_key_value_heads=2",
            "train.draft_intermediate_size=96",
            "train.head_init=random",
            f"train.draft_num_layers={layers}",
        ],
    )
    plan = draft_plan(cfg, str(target))
    planned = plan["config"]
    vocab = build_vocab(torch.arange(256, dtype=torch.int64) + 1, 32)
    built = build_model(cfg, target, vocab, SimpleNamespace(aux_width=None)).config.to_dict()
    assert planned["norm_before_residual"] is norm_before_residual
    assert planned["num_layers"] == layers
    assert (planned["num_key_value_heads"], planned["intermediate_size"]) == (2, 96)
    assert planned == built
