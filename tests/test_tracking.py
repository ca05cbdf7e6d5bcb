"""TensorBoard tracking (eagle3/tracking.py): a tiny train run's event files read back with
TensorBoard's own reader, verify's scalars from a report, the setting that turns it off (and
keys nothing), and the scalars page in headless Chromium with the run on it."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import httpx
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from eagle3.tracking import Tracker, run_log_dir, tensorboard_argv, track_verify
from eagle3.train import train
from tests.test_train import make_cfg, make_setup


def scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series of one run folder, as TensorBoard itself reads them."""
    ea = EventAccumulator(str(log_dir))
    ea.Reload()
    return {t: [(e.step, e.value) for e in ea.Scalars(t)] for t in ea.Tags()["scalars"]}


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory):
    """A tiny train run (the train tests' synthetic target and data, 2 epochs) in a profile's
    run dir, as the stage runs it: ``<runs>/<profile>/train/<key>``."""
    tmp, target, _, ext, vocab = make_setup(tmp_path_factory.mktemp("tracked"))
    cfg = make_cfg(epochs=2)
    cfg.paths.runs_dir = tmp / "runs"
    out = cfg.paths.artifact_dir("train", "0123456789abcdef")
    seen: list[dict] = []
    manifest = train(cfg, ext, vocab, target, out, on_progress=seen.append)
    return cfg, out, manifest, seen


def test_train_writes_step_and_epoch_scalars(tracked_run):
    cfg, out, manifest, seen = tracked_run
    logs = sorted((cfg.paths.run_dir / "tensorboard").iterdir())
    assert [p.name.split("-")[0] for p in logs] == ["train"] and logs[0].name.endswith(
        "-" + out.name[:8]
    )
    s = scalars(logs[0])
    steps = manifest["steps"]
    assert steps >= 4 and len(seen) == steps  # the caller's callback still gets every step
    # per step: one point per optimizer step, the values the callback got
    for tag in ("train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s"):
        assert tag in s, sorted(s)
    assert [st for st, _ in s["train/loss"]] == list(range(1, steps + 1))
    assert [v for _, v in s["train/loss"]] == pytest.approx([p["loss"] for p in seen], rel=1e-5)
    assert [v for _, v in s["train/lr"]] == pytest.approx([p["lr"] for p in seen], rel=1e-5)
    assert all(v > 0 for _, v in s["train/tokens_per_s"])
    # model FLOP/s: the step's real tokens x the draft's FLOPs a token (eagle3/train/flops.py) /
    # the step's time; no MFU on the CPU (no known peak)
    tflops = s["train/model_tflops_per_s"]
    assert len(tflops) == steps - 1 and all(v > 0 for _, v in tflops)  # from the 2nd step on
    assert all(p["tokens"] > 0 for p in seen) and "train/mfu" not in s
    for i in range(cfg.train.ttt_steps):  # per TTT position
        assert len(s[f"train/loss_pos{i}"]) == steps
        assert all(0 <= v <= 1 for _, v in s[f"train/top1_pos{i}"])
    # per epoch: metrics.json's means, x = epoch
    hist = json.loads((out / "metrics.json").read_text())["epochs"]
    for i in range(cfg.train.ttt_steps):
        assert s[f"epoch/loss_pos{i}"] == [
            (e["epoch"], pytest.approx(e["loss"][i], rel=1e-5)) for e in hist
        ]
        assert [v for _, v in s[f"epoch/top1_pos{i}"]] == pytest.approx(
            [e["top1"][i] for e in hist], rel=1e-5
        )
    assert [st for st, _ in s["epoch/seconds"]] == [1, 2] and "epoch/tokens_per_s" in s
    for part in ("host_s", "settle_s", "gc_s"):  # where each epoch's seconds went
        assert s[f"epoch/time_{part}"] == [
            (e["epoch"], pytest.approx(e["time"][part], rel=1e-5)) for e in hist
        ]
    assert "epoch/time_alloc_retries" not in s  # None without CUDA
    assert s["train/loop_s"] == [(steps, pytest.approx(manifest["loop_s"], rel=1e-5))]


def test_online_epoch_sources_and_step_wait(tmp_path):
    """What an online run adds (the epoch's state sources, the manifest's step wait), without a
    target: the tracker on the dicts the stage hands it."""
    from torch.utils.tensorboard import SummaryWriter

    tr = Tracker(SummaryWriter(str(tmp_path)), 1, tmp_path)
    states = {"memory": 3, "disk": 1, "produced": 4, "cached": 0}
    tr.train_epoch(
        {"epoch": 1, "loss": [2.0], "top1": [0.5], "tokens": 100, "s": 2.0, "states": states}
    )
    tr.train_end({"steps": 7, "loop_s": 9.5, "states": {"step_wait_s": 1.25, "produce_s": 3.5}})
    s = scalars(tmp_path)
    assert s["epoch/states_produced"] == [(1, 4.0)] and s["epoch/states_disk"] == [(1, 1.0)]
    assert s["epoch/tokens_per_s"] == [(1, 50.0)]
    assert s["train/states_step_wait_s"] == [(7, 1.25)] and s["train/states_produce_s"] == [
        (7, 3.5)
    ]
    assert tr.writer is None  # train_end closed it


def report_of_a_sweep() -> dict:
    """The parts of a verify report (eagle3/verify/runner.py) the tracker reads: a k=1,2 sweep."""
    return {
        "num_speculative_tokens": 2,
        "acceptance_length": 1.4,
        "acceptance": {"acceptance_per_position": [0.3, 0.1]},
        "ngram": {"acceptance_length_all_steps": 1.2},
        "offline": {
            "by_group": {
                "coding": {"acceptance_length": 1.5, "acceptance_per_position": [0.4, 0.1]},
                "roleplay": {"acceptance_length": 1.1, "acceptance_per_position": [0.1, 0.0]},
            }
        },
        "sweep": {
            "draft": {"measured_tokens_per_s": {"1": {"1": 17.5}, "2": {"1": 16.8}}},
            "ngram": {"measured_tokens_per_s": {"1": {"1": 20.0}, "2": {"1": 20.4}}},
            "baseline_tokens_per_s": {"1": 16.6},
        },
    }


def test_verify_scalars_from_its_report(tmp_path):
    # a run dir of its own: the module's tracked_run is read by tests that expect its train only
    cfg = make_cfg(epochs=2)
    cfg.paths.runs_dir = tmp_path / "runs"
    out = cfg.paths.artifact_dir("verify", "fedcba98")
    log_dir = track_verify(cfg, out, report_of_a_sweep())
    assert log_dir.parent == cfg.paths.run_dir / "tensorboard" and log_dir.name.startswith(
        "verify-"
    )
    s = scalars(log_dir)
    assert s["verify/acceptance_per_position"] == [(0, pytest.approx(0.3)), (1, pytest.approx(0.1))]
    assert s["verify/acceptance_length"] == [(2, pytest.approx(1.4))]
    assert s["verify/category_coding/acceptance_length"] == [(2, 1.5)]
    assert s["verify/category_roleplay/acceptance_per_position"][0] == (0, pytest.approx(0.1))
    assert s["verify/tokens_per_s_draft_c1"] == [(1, 17.5), (2, pytest.approx(16.8))]
    assert s["verify/tokens_per_s_ngram_c1"] == [(1, 20.0), (2, pytest.approx(20.4))]
    assert s["verify/tokens_per_s_target_c1"] == [(0, pytest.approx(16.6))]


def test_off_writes_nothing_and_keys_nothing(tmp_path):
    from eagle3.stages import NAMES, stage_config

    on = make_cfg(epochs=1)
    off = make_cfg(epochs=1)
    off.tracking.tensorboard = False
    assert all(stage_config(on, s) == stage_config(off, s) for s in NAMES)
    off.paths.runs_dir = tmp_path / "runs"
    assert track_verify(off, off.paths.artifact_dir("verify", "k"), report_of_a_sweep()) is None
    assert not (tmp_path / "runs").exists()


def test_log_dir_outside_the_run_dir_and_resumed(tmp_path):
    """A folder outside the profile's run dir keeps its events; a resumed run reuses its folder."""
    cfg = make_cfg(epochs=1)
    cfg.paths.runs_dir = tmp_path / "runs"
    assert (
        run_log_dir(cfg, "train", tmp_path / "elsewhere").parent
        == tmp_path / "elsewhere" / "tensorboard"
    )
    first = run_log_dir(cfg, "train", cfg.paths.artifact_dir("train", "abc"))
    first.mkdir(parents=True)
    assert run_log_dir(cfg, "train", cfg.paths.artifact_dir("train", "abc")) == first
    assert run_log_dir(cfg, "train", cfg.paths.artifact_dir("train", "abd")) != first


def test_tensorboard_page_shows_the_run(tracked_run, tmp_path):
    """`eagle3 tensorboard`'s server (127.0.0.1 only) over the profile's log dir, in headless
    Chromium: the scalars page lists the train run and draws its loss chart."""
    from tests.test_ui_browser import CHROMIUM, _free_port, _start, _stop, _wait

    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(
            "Debian's chromium is missing: `make test` installs it (apt-get install chromium)"
        )
    from playwright.sync_api import sync_playwright

    from tests.conftest import ARTIFACTS, CPU_PROFILE

    cfg, out, _, _ = tracked_run
    log_dir = cfg.paths.run_dir / "tensorboard"
    run_name = next(log_dir.glob("train-*")).name
    port = _free_port()
    argv = tensorboard_argv(log_dir, port)
    assert argv[argv.index("--host") + 1] == "127.0.0.1" and argv[0] == sys.executable
    # the README's command: the CPU profile pointed at this run's folder
    over = [f"paths.runs_dir={cfg.paths.runs_dir}", f"paths.run_name={cfg.paths.run_name}"]
    argv = [sys.executable, "-m", "eagle3.cli", "tensorboard", "-c", str(CPU_PROFILE)]
    argv += [*(x for o in over for x in ("--set", o)), "--port", str(port)]
    log = tmp_path / "tensorboard.log"
    proc = _start(argv, dict(os.environ), log)
    url = f"http://127.0.0.1:{port}"
    ARTIFACTS.mkdir(exist_ok=True)
    try:
        runs = _wait(
            "tensorboard",
            lambda: httpx.get(f"{url}/data/runs", timeout=2).json(),
            60,
            [(proc, log)],
        )
        assert run_name in runs
        # the server reads the run's loss as the event files hold it
        served = httpx.get(
            f"{url}/data/plugin/scalars/scalars",
            params={"run": run_name, "tag": "train/loss"},
            timeout=10,
        ).json()
        assert [row[1] for row in served] == [
            st for st, _ in scalars(log_dir / run_name)["train/loss"]
        ]
        with sync_playwright() as p:
            browser = p.chromium.launch(
                executable_path=CHROMIUM, args=["--no-sandbox", "--disable-dev-shm-usage"]
            )
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            try:
                page.goto(f"{url}/#scalars", wait_until="networkidle")
                page.get_by_text(run_name).first.wait_for(timeout=30_000)
                page.get_by_text("train/loss_pos0").first.wait_for(timeout=30_000)
                page.wait_for_load_state("networkidle")
                page.screenshot(path=str(ARTIFACTS / "tensorboard-scalars.png"), full_page=True)
            except BaseException:
                page.screenshot(path=str(ARTIFACTS / "tensorboard-failure.png"), full_page=True)
                raise
            finally:
                browser.close()
    finally:
        _stop(proc)


def test_model_flops_and_mfu_per_step(monkeypatch):
    """Model TFLOP/s = a rank's share of the step's real tokens x FLOPs a token / the step's
    time; MFU divides by the GPU's peak (where the table knows it)."""
    import eagle3.tracking as tracking
    from eagle3.train.flops import PEAK_BF16, peak_flops

    got: dict[str, float] = {}

    class Writer:
        def add_scalar(self, tag, value, step):
            got[tag] = value

    clock = iter([100.0, 100.0, 102.0, 102.0])
    monkeypatch.setattr(tracking.time, "monotonic", lambda: next(clock))
    tr = tracking.Tracker(Writer())
    tr.set_flops(3e9, PEAK_BF16["H100"], world=2)
    step = {"steps": [{"count": 10, "correct": 5}], "tokens": 4000, "total_steps": 9}
    tr.train_step({**step, "step": 1})
    assert "train/mfu" not in got  # no previous step: no time yet
    tr.train_step({**step, "step": 2})  # 2 s later: 2,000 tokens a rank x 3 GFLOP / 2 s
    assert got["train/model_tflops_per_s"] == pytest.approx(3.0)
    assert got["train/mfu"] == pytest.approx(3e12 / 989e12)
    assert peak_flops(torch.device("cpu")) is None
