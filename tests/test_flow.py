"""The hero-run flow under a Prefect test harness, against the session's real vLLM server
(attached through the external backend, so these tests do not pay another server start)."""

import json
import shutil
from pathlib import Path

import pytest

from eagle3.serving.readiness import probe
from tests.conftest import CPU_PROFILE, TINY_STAGES

pytestmark = pytest.mark.vllm


def test_hero_run_flow(tiny_hero, vllm_server):
    """The session's tiny hero run: every stage ran, wrote its keyed folder and sealed it."""
    from eagle3 import artifacts

    summary, run_dir = tiny_hero.summary, tiny_hero.runs_dir / "smollm2-cpu"
    assert list(summary["stages"]) == TINY_STAGES
    assert all(
        s["status"] == "ran" and s["state"] == "Completed" for s in summary["stages"].values()
    )
    # generate had prompts to request: the flow attached to the external server and smoke-tested it
    assert summary["server"]["backend"] == "external" and not summary["server"]["started_here"]
    assert (
        "paris" in summary["smoke_chat"]["content"].lower()
        and summary["smoke_chat"]["completion_token_ids"]
    )
    assert summary["generate_status"]["pending"] == 4 and summary["failed"] is None
    on_disk = json.loads((run_dir / "hero-run.json").read_text())
    assert on_disk == json.loads(json.dumps(summary))
    info = {s: c["info"] for s, c in summary["stages"].items()}
    assert info["generate"]["samples"] == 4 and info["extract"]["samples"] == 4
    assert info["extract"]["aux_layers"] == [2, 15, 27]
    assert 0 < info["vocab"]["coverage"] <= 1 and info["train"]["steps"] >= 1
    for stage, c in summary["stages"].items():
        folder = Path(c["dir"])
        assert folder == run_dir / stage / c["key"] and artifacts.is_complete(folder, c["key"])
        assert (run_dir / stage / "latest").resolve() == folder
    assert (Path(summary["stages"]["train"]["dir"]) / "vllm-draft" / "config.json").exists()
    # a stage's task wraps its library call: it took at least as long (how much longer is
    # Prefect's bookkeeping, a speed, not a behaviour: not checked here)
    assert all(c["overhead_s"] >= 0 for c in summary["stages"].values())
    # the shared server still answers: a run against an external server never stops it
    assert probe(vllm_server.base_url, None) is None


def test_hero_run_with_verify_prints_acceptance_length(tiny_hero, smol_model, tmp_path, capsys):
    """The whole hero run through `python -m flows.hero_run` (what `make demo` runs): the earlier
    stages are cache hits, verify measures the shared server (baseline) against target + the
    draft the hero run trained (speculative), and the run ends by printing the acceptance length."""
    from eagle3.config import load_config
    from eagle3.serving.server import start_server
    from flows.hero_run import main

    runs = tmp_path / "runs"
    shutil.copytree(tiny_hero.runs_dir, runs, symlinks=True)
    draft = runs / "smollm2-cpu" / "train" / "latest" / "vllm-draft"
    cfg = load_config(CPU_PROFILE, ["serve.port=0", "verify.num_speculative_tokens=2"])
    spec = {
        "method": "eagle3",
        "model": str(draft.resolve()),
        "num_speculative_tokens": cfg.verify.num_speculative_tokens,
    }
    with start_server(
        cfg, str(smol_model), speculative_config=spec, log_dir=tmp_path / "spec-logs"
    ) as server:
        argv = ["--config", str(CPU_PROFILE)]
        for o in [*tiny_hero.with_runs_dir(runs), f"verify.speculative_base_url={server.base_url}"]:
            argv += ["--set", o]
        summary = main(argv)
    out = capsys.readouterr().out
    stages = summary["stages"]
    assert [stages[s]["status"] for s in TINY_STAGES] == ["cached"] * 4 and stages["verify"][
        "status"
    ] == "ran"
    assert (
        summary["server"] is None
    )  # nothing to generate: no target server was started for generate
    al = summary["acceptance_length"]
    assert al is not None and 1.0 <= al <= 1 + cfg.verify.num_speculative_tokens
    lines = out.splitlines()
    assert any(line.startswith(f"acceptance length: {al}") for line in lines)
    assert any(line.startswith("measured (each at its best k): c=1: draft k=2 ") for line in lines)
    verify_dir = Path(stages["verify"]["dir"])
    assert (verify_dir / "report.json").is_file() and stages["verify"]["info"]["gate"]["passed"]
    report = json.loads((verify_dir / "report.json").read_text())
    assert report["acceptance_length"] == al
    # the gate's word is what it checked (the tiny profile does not require beating n-gram)
    assert any(line.startswith("gate: passed its acceptance checks (") for line in lines)
    # the verdict closes the run: the fastest measured at c=1 (issue 41)
    e = report["serving"]["1"]
    measured = {"draft": e["tokens_per_s"], "the target alone": e["tokens_per_s"] / e["speedup"]}
    if e.get("ngram"):
        measured["n-gram"] = e["ngram"]["tokens_per_s"]
    fastest = max(measured, key=measured.get)
    verdict = [i for i, line in enumerate(lines) if line.startswith("serve on this machine: ")]
    assert verdict and lines[verdict[0]].startswith(f"serve on this machine: c=1: {fastest}")
    tail = lines[verdict[0] :]
    assert len(tail) == (1 if fastest == "draft" else 4)  # why it loses, what wins
    if fastest != "draft":
        assert tail[1].startswith("why the draft loses: it trained on 4 samples in ")
        assert "smollm2-sharegpt" in tail[2] and "2.724-2.727" in tail[3]
    # TensorBoard: the hero run's train run and this verify side by side in the profile's log dir
    from tests.test_tracking import scalars

    tb = runs / "smollm2-cpu" / "tensorboard"
    assert sorted(p.name.split("-")[0] for p in tb.iterdir()) == ["train", "verify"]
    train_tb = scalars(next(tb.glob("train-*")))
    assert len(train_tb["train/loss"]) == stages["train"]["info"]["steps"]
    verify_tb = scalars(next(tb.glob("verify-*")))
    assert verify_tb["verify/acceptance_length"][0][1] == pytest.approx(al, rel=1e-5)


def test_hero_run_with_online_states(tiny_hero, tmp_path):
    """The hero run through Prefect with ``extract.states: online`` on a copy of the session's
    run: generate is a cache hit, extract reruns and stores token ids and masks only, vocab is a
    cache hit (the same tokens: its key does not change), train produces the states itself."""
    from flows.hero_run import HeroRunParams, hero_run

    runs = tmp_path / "runs"
    shutil.copytree(tiny_hero.runs_dir, runs, symlinks=True)
    overrides = [*tiny_hero.with_runs_dir(runs), "extract.states=online"]
    summary = hero_run(
        HeroRunParams(profile=str(CPU_PROFILE), overrides=overrides, stages=TINY_STAGES)
    )
    stages = summary["stages"]
    assert [stages[s]["status"] for s in TINY_STAGES] == ["cached", "ran", "cached", "ran"]
    extract_dir, train_dir = Path(stages["extract"]["dir"]), Path(stages["train"]["dir"])
    assert json.loads((extract_dir / "manifest.json").read_text())["states"] == "online"
    off = tiny_hero.summary["stages"]["extract"]
    assert stages["extract"]["key"] != off["key"]
    st = json.loads((train_dir / "manifest.json").read_text())["states"]
    assert st["mode"] == "online" and st["produced"] > 0
    # auto: every state fits memory, so each sample is produced once and later epochs read it
    assert st["memory_bytes"] == st["cache_plan"]["total_bytes"] > 0 and st["disk_samples"] == 0
    assert st["produced"] == st["memory_samples"]
    # TensorBoard: the online run's state sources per epoch and the producer's time (eagle3/tracking.py)
    from tests.test_tracking import scalars

    tb = scalars(next((runs / "smollm2-cpu" / "tensorboard").glob(f"train-*-{train_dir.name[:8]}")))
    assert tb["epoch/states_produced"] == [(1, st["produced"])]
    assert tb["train/states_produce_s"][0][1] == pytest.approx(st["produce_s"], abs=1e-3)
    assert (train_dir / "vllm-draft" / "config.json").is_file()
