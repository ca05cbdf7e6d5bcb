"""Orchestration: content keys (the invalidation matrix), completeness checks, the generate
status that decides whether a server is needed, and the real flow's reruns: an unchanged rerun
is all cache hits with no server, a failed stage is redone alone with its dependants, a damaged
artifact is rebuilt, ``force`` and ``stages`` behave, nightly regeneration reruns downstream
stages only when the data changed. Plus the deployments, prefect.yaml, and the cleanup hooks."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from eagle3 import artifacts, stages
from eagle3.config import load_config
from eagle3.generate import status as generate_status_mod
from tests.conftest import CPU_PROFILE, ROOT, TINY_STAGES

# ---------------------------------------------------------------------------
# Keys: which settings rerun which stages (no server, no Prefect)


@pytest.mark.parametrize(
    "override, rerun",
    [
        (
            "extract.aux_layers=[2,10,20]",
            ["extract", "train", "verify"],
        ),  # vocab reads tokens, not states
        ("extract.storage_dtype=float8_e4m3fn", ["extract", "train", "verify"]),
        ("extract.max_seq_len=512", ["extract", "vocab", "train", "verify"]),  # the tokens change
        ("train.epochs=3", ["train", "verify"]),
        ("train.lr=0.01", ["train", "verify"]),
        ("vocab.draft_vocab_size=4096", ["vocab", "train", "verify"]),
        ("verify.max_tokens=32", ["verify"]),  # the CPU profile asks 64
        ("verify.num_speculative_tokens=4", ["verify"]),  # the CPU profile sweeps [1, 2]
        ("serve.extra_args=[]", ["verify"]),  # performance flags matter to a speed measurement only
        ("generate.max_tokens=100", ["generate", "extract", "vocab", "train", "verify"]),
        ("generate.temperature=0.7", ["generate", "extract", "vocab", "train", "verify"]),
        ("serve.dtype=float16", ["generate", "extract", "vocab", "train", "verify"]),
        ("target.model=/models/other", ["generate", "extract", "vocab", "train", "verify"]),
        # how or where a stage runs, not what it produces: no key changes
        ("train.grad_accum=2", ["train", "verify"]),
        ("train.checkpoint_every_steps=7", []),
        ("train.distributed=fsdp", []),  # the same draft, sharded differently
        ("generate.concurrency=8", []),
        ("generate.timeout_s=30", []),
        ("generate.shard_size=10", []),
        ("extract.token_budget=1024", []),
        ("extract.device=cpu", []),
        ("serve.port=1234", []),
        ("serve.ready_timeout_s=60", []),
        ("verify.timeout_s=30", []),
        ("paths.runs_dir=/elsewhere", []),
        ("paths.run_name=other", []),
        ("target.served_model_name=alias", []),
    ],
)
def test_invalidation_matrix(cpu_cfg, override, rerun):
    assert stages.changed_stages(cpu_cfg, load_config(CPU_PROFILE, [override])) == rerun


def test_keys_follow_inputs_and_code_version(cpu_cfg, monkeypatch):
    keys = stages.config_keys(cpu_cfg)
    assert len(set(keys.values())) == 5
    assert stages.config_keys(cpu_cfg) == keys  # stable across calls
    # new generated data (same settings) reruns everything after generate, but not generate itself
    other = stages.config_keys(cpu_cfg, generate_data="more-samples")
    assert [s for s in stages.NAMES if other[s] != keys[s]] == [
        "extract",
        "vocab",
        "train",
        "verify",
    ]
    # a stage's code version is part of its key and so of every later key
    monkeypatch.setitem(
        stages.STAGES, "vocab", dataclasses.replace(stages.STAGES["vocab"], code_version="2")
    )
    bumped = stages.config_keys(cpu_cfg)
    assert [s for s in stages.NAMES if bumped[s] != keys[s]] == ["vocab", "train", "verify"]
    # torchrun: W ranks with grad_accum 1 make the same optimizer steps as 1 process with grad_accum W
    accum2 = stages.config_keys(load_config(CPU_PROFILE, ["train.grad_accum=2"]))["train"]
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert stages.config_keys(cpu_cfg)["train"] == accum2 != bumped["train"]
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(ValueError, match="input keys missing"):
        stages.stage_key(cpu_cfg, "train", {"extract": "x"})
    assert stages.dependants(["extract"]) == {"extract", "vocab", "train", "verify"}
    assert stages.dependants(["vocab"]) == {"vocab", "train", "verify"}


def test_seal_and_completeness(tmp_path, cpu_cfg):
    cfg = load_config(CPU_PROFILE, [f"paths.runs_dir={tmp_path}"])
    d = cfg.paths.artifact_dir("vocab", "k1")
    assert artifacts.problems(d, "k1") == [f"{d}: no artifact.json (never finished)"]
    (d / "sub").mkdir(parents=True)
    (d / "vocab.safetensors").write_bytes(b"x" * 10)
    (d / "sub" / "a.json").write_text("{}")
    (d / ".tmp-half-written").write_text("ignored")
    artifacts.seal(d, "vocab", "k1", "1", {"extract": "t"}, {"coverage": 1.0})
    assert artifacts.is_complete(d, "k1") and not artifacts.is_complete(d, "k2")
    assert set(artifacts.read_marker(d)["files"]) == {"vocab.safetensors", "sub/a.json"}
    (d / "vocab.safetensors").write_bytes(b"x" * 9)  # truncated
    assert "9 bytes, 10 when sealed" in artifacts.problems(d, "k1")[0]
    (d / "vocab.safetensors").unlink()
    assert artifacts.problems(d, "k1")[0].endswith("missing")
    # latest: a relative symlink that stage_dir (what the CLI reads) follows
    assert cfg.paths.stage_dir("vocab") == cfg.paths.stage_root("vocab")
    artifacts.set_latest(cfg, "vocab", "k1")
    assert os.readlink(cfg.paths.stage_root("vocab") / "latest") == "k1"
    assert cfg.paths.stage_dir("vocab") == d.resolve()
    assert artifacts.latest(cfg, "vocab") is None  # incomplete artifacts are never "latest"


def test_generate_status_decides_without_a_server(tmp_path):
    """Pending = selected prompts never answered or failed for a transient reason; prompts the
    server rejected count only with retry_rejected. The data key ignores errors."""
    from eagle3.generate.storage import ShardStore

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"question {i}?"}) + "\n" for i in range(5)))
    cfg = load_config(
        CPU_PROFILE,
        [f"paths.runs_dir={tmp_path}", f"generate.dataset={data}", "generate.num_samples=null"],
    )
    ids = generate_status_mod.selected_prompt_ids(cfg)
    st = generate_status_mod.generate_status(cfg)
    assert (st.selected, st.done, st.pending, st.sealed) == (5, 0, 5, False)
    store = ShardStore(Path(st.out_dir))
    for i in ids[:2]:
        store.add({"id": i, "prompt_token_ids": [1], "completion_token_ids": [2]})
    store.add_error({"id": ids[2], "kind": "failed", "reason": "timeout"})
    store.add_error({"id": ids[3], "kind": "rejected", "reason": "400"})
    store.finalize()
    st = generate_status_mod.generate_status(cfg)
    assert (st.done, st.pending, st.rejected) == (2, 2, 1)
    assert (
        generate_status_mod.generate_status(
            load_config(
                CPU_PROFILE,
                [
                    f"paths.runs_dir={tmp_path}",
                    f"generate.dataset={data}",
                    "generate.num_samples=null",
                    "generate.retry_rejected=true",
                ],
            )
        ).pending
        == 3
    )
    key = generate_status_mod.data_key(Path(st.out_dir), st.key)
    store = ShardStore(Path(st.out_dir))
    store.add_error({"id": ids[2], "kind": "failed", "reason": "timeout again"})
    store.finalize()
    assert (
        generate_status_mod.data_key(Path(st.out_dir), st.key) == key
    )  # a failed retry is no new data
    store = ShardStore(Path(st.out_dir))
    store.add({"id": ids[2], "prompt_token_ids": [1], "completion_token_ids": [3]})
    store.finalize()
    assert generate_status_mod.data_key(Path(st.out_dir), st.key) != key
    # a new prompt in the dataset changes the selection (a cache miss) and is pending
    with open(data, "a") as f:
        f.write(json.dumps({"prompt": "a new question?"}) + "\n")
    st2 = generate_status_mod.generate_status(cfg)
    assert st2.selection != st.selection and st2.pending == 2


# ---------------------------------------------------------------------------
# A new stage is one registry entry: the CLI and the flow run it with no code of their own


def _vocab_report_stage() -> stages.Stage:
    """A toy stage after vocab (docs/orchestration.md, "Adding a stage"): the draft vocab's size."""
    from eagle3.vocab import load_vocab

    def run(r: stages.StageRun) -> dict:
        v = load_vocab(stages.STAGES["vocab"].file(r.inputs["vocab"], "vocab"))
        r.out_dir.mkdir(parents=True, exist_ok=True)
        report = {"draft_vocab_size": int(v.d2t.numel()), "top": int(v.draft_ids[0])}
        (r.out_dir / "report.json").write_text(json.dumps(report))
        return report

    return stages.Stage(
        "vocab-report",
        ("vocab",),
        lambda cfg: {"draft_vocab_size": cfg.vocab.draft_vocab_size},
        run,
        lambda r, result: result,
        {"report": "report.json"},
    )


def _hello_stage() -> stages.Stage:
    def run(r: stages.StageRun) -> dict:
        r.out_dir.mkdir(parents=True, exist_ok=True)
        (r.out_dir / "hello.txt").write_text(f"hello from {r.cfg.name}\n")
        return {"said": "hello"}

    return stages.Stage("hello", (), lambda cfg: {"name": cfg.name}, run, lambda r, x: x)


def test_new_stage_runs_from_the_cli(tmp_path, monkeypatch):
    """``eagle3 run-stage NAME`` runs any registry entry: keyed folder, sealed, latest."""
    from typer.testing import CliRunner

    from eagle3.cli import app

    monkeypatch.setitem(stages.STAGES, "hello", _hello_stage())
    argv = ["run-stage", "hello", "-c", str(CPU_PROFILE), "-s", f"paths.runs_dir={tmp_path}"]
    res = CliRunner().invoke(app, argv)
    assert res.exit_code == 0, res.output
    cfg = load_config(CPU_PROFILE, [f"paths.runs_dir={tmp_path}"])
    out = cfg.paths.artifact_dir("hello", stages.stage_key(cfg, "hello"))
    assert (out / "hello.txt").read_text() == "hello from smollm2-cpu\n"
    assert artifacts.read_marker(out)["result"] == {"said": "hello"}
    assert artifacts.latest(cfg, "hello")[0].resolve() == out.resolve()
    assert '{"said": "hello"}' in res.output
    bad = CliRunner().invoke(app, ["run-stage", "nope", "-c", str(CPU_PROFILE)])
    assert bad.exit_code != 0 and "unknown stage 'nope'" in bad.output
    wrong = CliRunner().invoke(app, [*argv, "--input", "vocab=/tmp"])  # hello reads nothing
    assert wrong.exit_code != 0 and "--input 'vocab=/tmp': expected STAGE=FOLDER" in wrong.output


# ---------------------------------------------------------------------------
# The real flow (tiny hero run of the session, against the shared vLLM server)


def _run(overrides, stages=TINY_STAGES, force=(), fail=False) -> dict:
    from flows.hero_run import HeroRunParams, hero_run

    params = HeroRunParams(
        profile=str(CPU_PROFILE), overrides=overrides, stages=list(stages), force=list(force)
    )
    if not fail:
        return hero_run(params)
    state = hero_run(params, return_state=True)
    assert state.is_failed(), state
    runs_dir = Path(next(o for o in overrides if o.startswith("paths.runs_dir=")).split("=", 1)[1])
    return json.loads((runs_dir / "smollm2-cpu" / "hero-run.json").read_text())


def _status(summary: dict) -> dict[str, str]:
    return {s: c["status"] for s, c in summary["stages"].items()}


@pytest.fixture
def tiny_copy(tiny_hero, tmp_path):
    """A copy of the session's finished tiny hero run: tests may damage it."""
    runs = tmp_path / "runs"
    shutil.copytree(tiny_hero.runs_dir, runs, symlinks=True)
    return tiny_hero.with_runs_dir(runs)


@pytest.mark.vllm
def test_unchanged_rerun_is_all_cache_hits_and_starts_no_server(tiny_hero, tiny_copy):
    t0 = time.monotonic()
    summary = _run(tiny_copy)  # a copy: the session's run dir stays as its first run left it
    wall = time.monotonic() - t0
    assert _status(summary) == {s: "cached" for s in TINY_STAGES}
    assert summary["server"] is None and summary["smoke_chat"] is None
    assert summary["generate_status"]["pending"] == 0
    for s in TINY_STAGES:  # the same folders as the first run
        assert summary["stages"][s]["key"] == tiny_hero.summary["stages"][s]["key"]
    print(
        f"\nunchanged rerun of the tiny hero run: {wall:.2f} s; per stage (task s): "
        f"{ {s: c['task_wall_s'] for s, c in summary['stages'].items()} }"
    )
    assert wall < 30


@pytest.mark.vllm
def test_rerun_after_failure_redoes_only_the_failed_stage(tiny_copy, monkeypatch):
    """train fails (injected) -> the rerun finds generate/extract/vocab cached, redoes train; then
    `stages` runs train alone on the latest artifacts."""

    def broken(*args, **kwargs):
        raise ValueError("injected failure in train")

    overrides = [*tiny_copy, "train.epochs=2"]  # a train key the copy has not computed
    with monkeypatch.context() as m:
        m.setattr("eagle3.train.train", broken)  # what the train stage calls (eagle3.stages)
        failed = _run(overrides, fail=True)
    assert _status(failed) == {
        "generate": "cached",
        "extract": "cached",
        "vocab": "cached",
        "train": "failed",
    }
    assert failed["failed"]["stage"] == "train" and "injected failure" in failed["failed"]["error"]
    assert failed["server"] is None

    again = _run(overrides)
    assert _status(again) == {
        "generate": "cached",
        "extract": "cached",
        "vocab": "cached",
        "train": "ran",
    }
    assert again["stages"]["train"]["info"]["epochs"] == 2

    only_train = _run(overrides, stages=["train"])
    assert _status(only_train) == {
        "generate": "latest",
        "extract": "latest",
        "vocab": "latest",
        "train": "cached",
    }
    assert only_train["stages"]["train"]["key"] == again["stages"]["train"]["key"]


@pytest.mark.vllm
def test_damaged_artifact_is_rebuilt_and_force_recomputes_dependants(tiny_copy):
    first = _run(tiny_copy)
    vocab_dir = Path(first["stages"]["vocab"]["dir"])
    (vocab_dir / "vocab.safetensors").unlink()  # a cached record alone is not trusted
    rebuilt = _run(tiny_copy)
    assert _status(rebuilt) == {
        "generate": "cached",
        "extract": "cached",
        "vocab": "ran",
        "train": "cached",
    }
    assert (vocab_dir / "vocab.safetensors").is_file() and artifacts.is_complete(vocab_dir)

    forced = _run(tiny_copy, force=["vocab"])
    assert _status(forced) == {
        "generate": "cached",
        "extract": "cached",
        "vocab": "ran",
        "train": "ran",
    }
    assert (
        forced["stages"]["train"]["key"] == first["stages"]["train"]["key"]
    )  # same inputs, same folder


@pytest.mark.vllm
def test_new_stage_runs_in_the_hero_run(tiny_copy, monkeypatch):
    """A stage added to the registry alone runs in the hero run (tasks/stage.py's generic task),
    after the stages it reads, cached on the next run like the others."""
    from flows.hero_run import HeroRunParams, hero_run

    monkeypatch.setitem(stages.STAGES, "vocab-report", _vocab_report_stage())
    selected = [*TINY_STAGES, "vocab-report"]
    # HeroRunParams' stage list was fixed when the flow module was imported, before this toy
    # stage existed: model_construct skips that check (a real stage is in the list from import)
    params = HeroRunParams.model_construct(
        profile=str(CPU_PROFILE), overrides=tiny_copy, stages=selected, force=[]
    )
    first = hero_run(params)
    assert _status(first) == {**{s: "cached" for s in TINY_STAGES}, "vocab-report": "ran"}
    report = stages.STAGES["vocab-report"].file(first["stages"]["vocab-report"]["dir"], "report")
    assert (
        json.loads(report.read_text())["draft_vocab_size"]
        == first["stages"]["vocab"]["info"]["draft_vocab_size"]
    )
    again = hero_run(params)
    assert _status(again)["vocab-report"] == "cached"


@pytest.mark.vllm
def test_nightly_regeneration_reruns_downstream_only_when_data_changed(tiny_hero, tiny_copy):
    """The nightly deployment is the hero run: with no new prompt nothing runs and no server
    starts; a new prompt is requested alone, and the later stages rerun on the new data."""
    unchanged = _run(tiny_copy)
    assert _status(unchanged) == {s: "cached" for s in TINY_STAGES} and unchanged["server"] is None

    original = tiny_hero.dataset.read_text()
    try:
        tiny_hero.dataset.write_text(
            original + json.dumps({"prompt": "Name a primary colour."}) + "\n"
        )
        grown = _run(tiny_copy)
    finally:
        tiny_hero.dataset.write_text(original)
    assert grown["generate_status"]["pending"] == 1 and grown["server"] is not None
    assert _status(grown) == {s: "ran" for s in TINY_STAGES}
    gen = grown["stages"]["generate"]
    assert gen["key"] == unchanged["stages"]["generate"]["key"]  # the same folder, one sample more
    assert (
        gen["info"]["samples"] == 5
        and gen["info"]["data_key"] != unchanged["stages"]["generate"]["info"]["data_key"]
    )
    ext = grown["stages"]["extract"]["info"]
    assert ext["samples"] == 5 and (ext["reused"], ext["computed"]) == (4, 1), (
        ext
    )  # only the new one computed


# ---------------------------------------------------------------------------
# Deployments, prefect.yaml, hooks


def test_deployments_served_by_make_ui():
    from flows.hero_run import ALL_STAGES, HeroRunParams
    from flows.serve import DEPLOYMENT_NAMES, deployments

    deps = {d.name: d for d in deployments(overrides=["train.epochs=2"], timezone="Europe/Berlin")}
    assert list(deps) == DEPLOYMENT_NAMES == ["hero-run", *ALL_STAGES, "nightly-regeneration"]
    for name, d in deps.items():
        p = HeroRunParams.model_validate(d.parameters["params"])
        assert p.overrides == ["train.epochs=2"] and d.entrypoint == "flows/hero_run.py:hero_run"
        assert p.stages == ([name] if name in ALL_STAGES else ALL_STAGES)
    (sched,) = deps["nightly-regeneration"].schedules
    assert (sched.schedule.cron, sched.schedule.timezone) == ("0 2 * * *", "Europe/Berlin")
    assert not deps["hero-run"].schedules
    # the UI's form: one typed object whose stages are a choice among the five
    schema = deps["hero-run"]._parameter_openapi_schema.model_dump()
    assert "params" in schema["properties"]
    assert "verify" in json.dumps(schema["definitions"]["HeroRunParams"]["properties"]["stages"])


def test_prefect_yaml_matches_the_flow():
    from flows.hero_run import ALL_STAGES, HeroRunParams

    spec = yaml.safe_load((ROOT / "deploy" / "prefect.yaml").read_text())
    deps = {d["name"]: d for d in spec["deployments"]}
    assert set(deps) == {"hero-run", *ALL_STAGES, "nightly-regeneration"}
    for name, d in deps.items():
        assert (
            d["entrypoint"] == "flows/hero_run.py:hero_run"
            and d["work_pool"]["name"] == "eagle3-process"
        )
        p = HeroRunParams.model_validate(d["parameters"]["params"])
        assert (ROOT / p.profile).is_file()
        assert p.stages == ([name] if name in ALL_STAGES else ALL_STAGES)
    (sched,) = deps["nightly-regeneration"]["schedules"]
    assert sched["cron"] == "0 2 * * *" and sched["timezone"]
    from eagle3.serving.units import validate_unit

    units = ROOT / "deploy" / "systemd"
    for name in ("prefect-server.service", "prefect-worker.service"):
        assert validate_unit((units / name).read_text()) == [], name
    assert (
        "prefect worker start --pool eagle3-process"
        in (units / "prefect-worker.service").read_text()
    )
    assert "--host 127.0.0.1" in (units / "prefect-server.service").read_text()


def test_hooks_stop_servers_the_run_left(tmp_path):
    """After a crash or a cancellation the Server objects are gone: the hook stops the process
    groups this flow run recorded, and only those."""
    from flows.hero_run import _stop_servers_hook
    from tasks.serve import REGISTRY

    cfg = load_config(CPU_PROFILE, [f"paths.runs_dir={tmp_path}"])
    mine = subprocess.Popen(["sleep", "300"], start_new_session=True)
    other = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        reg = cfg.paths.stage_root("serve") / REGISTRY
        reg.parent.mkdir(parents=True)
        reg.write_text(
            json.dumps(
                [
                    {
                        "backend": "process",
                        "pid": mine.pid,
                        "base_url": "http://127.0.0.1:1",
                        "flow_run_id": "run-a",
                    },
                    {
                        "backend": "process",
                        "pid": other.pid,
                        "base_url": "http://127.0.0.1:2",
                        "flow_run_id": "run-b",
                    },
                ]
            )
        )
        params = {
            "params": {"profile": str(CPU_PROFILE), "overrides": [f"paths.runs_dir={tmp_path}"]}
        }
        _stop_servers_hook(
            None,
            SimpleNamespace(id="run-a", name="a", parameters=params),
            SimpleNamespace(name="Crashed"),
        )
        assert mine.wait(timeout=10) == -signal.SIGTERM
        assert other.poll() is None
        assert [e["flow_run_id"] for e in json.loads(reg.read_text())] == ["run-b"]
    finally:
        for p in (mine, other):
            if p.poll() is None:
                p.kill()
                p.wait()
