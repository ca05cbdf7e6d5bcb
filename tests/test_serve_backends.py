"""Serve backends that need no real vLLM: systemd (through a stand-in systemctl, because no
systemd runs on these machines), external, and the pre-flight errors of the process backend.
"""

import json
import socket

import pytest

from eagle3.config import load_config
from eagle3.errors import EndpointError
from eagle3.serving.readiness import (
    PortInUseError,
    ServerDiedError,
    ServerError,
    free_port,
    wait_until_ready,
)
from eagle3.serving.server import start_server
from tests.conftest import CPU_PROFILE, stub_argv
from tests.fakes import openai_stub  # noqa: F401  (the stub must stay importable)


def _cfg(*overrides):
    return load_config(CPU_PROFILE, ["serve.poll_interval_s=0.2", *overrides])


def _systemd_cfg(port, *more):
    return _cfg(
        "serve.backend=systemd",
        "serve.unit=vllm-test",
        f"serve.port={port}",
        "serve.ready_timeout_s=20",
        *more,
    )


def _calls(state):
    return (state / "calls.log").read_text().splitlines()


def test_systemd_starts_waits_and_stops(fake_systemd):
    port = free_port()
    (fake_systemd / "vllm-test.cmd").write_text(
        json.dumps(stub_argv(port, "smollm2-135m-instruct"))
    )
    with start_server(_systemd_cfg(port), "ignored") as server:
        assert server.backend == "systemd" and server.started_here
        assert server.base_url == f"http://127.0.0.1:{port}"
    calls = _calls(fake_systemd)
    assert "systemctl start vllm-test" in calls and calls[-1] == "systemctl stop vllm-test"


def test_systemd_unit_already_running_is_not_stopped(fake_systemd):
    port = free_port()
    (fake_systemd / "vllm-test.cmd").write_text(
        json.dumps(stub_argv(port, "smollm2-135m-instruct"))
    )
    import subprocess

    subprocess.run(["systemctl", "start", "vllm-test"], check=True)  # "someone else" started it
    try:
        with start_server(_systemd_cfg(port), "ignored") as server:
            assert not server.started_here
        assert _calls(fake_systemd).count("systemctl start vllm-test") == 1
        assert "systemctl stop vllm-test" not in _calls(fake_systemd)
    finally:
        subprocess.run(["systemctl", "stop", "vllm-test"])


def test_systemd_unit_death_reports_journal_at_once(fake_systemd):
    port = free_port()
    # the "server" crashes after 1 s without ever answering: a dead unit, not a slow one
    argv = stub_argv(port, "smollm2-135m-instruct", "--die-after", "1")
    (fake_systemd / "vllm-test.cmd").write_text(json.dumps(argv))
    cfg = _systemd_cfg(
        port + 1 if port < 65535 else port - 1
    )  # readiness polls a port nobody answers
    # reported as a death (ServerDiedError), not as serve.ready_timeout_s running out (20 s here:
    # ServerTimeoutError, which this would not catch)
    with pytest.raises(ServerDiedError) as e:
        start_server(cfg, "ignored")
    msg = str(e.value)
    assert (
        "vllm-test died" in msg
        and "journalctl -u vllm-test -n 50" in msg
        and "CUDA out of memory" in msg
    )


def test_systemd_missing_unit_is_clear(fake_systemd):
    with pytest.raises(ServerError, match="Unit vllm-test.service not found"):
        start_server(_systemd_cfg(free_port()), "ignored")


def test_external_backend_checks_the_model(tmp_path, monkeypatch):
    import subprocess

    from eagle3.serving import readiness

    probes = []
    probe = readiness.probe
    monkeypatch.setattr(readiness, "probe", lambda *a, **k: probes.append(a) or probe(*a, **k))
    port = free_port()
    stub = subprocess.Popen(stub_argv(port, "other-model"))
    try:
        wait_until_ready(  # the stub answers before the first probe counted below
            f"http://127.0.0.1:{port}",
            None,
            timeout_s=60,
            poll_interval_s=0.1,
            check_alive=lambda: None,
        )
        probes.clear()
        cfg = _cfg(
            "serve.backend=external",
            f"serve.base_url=http://127.0.0.1:{port}",
            "serve.ready_timeout_s=30",  # were the list waited on: a ServerTimeoutError in 30 s
        )
        with pytest.raises(
            EndpointError,
            match=r"does not list 'smollm2-135m-instruct' \(it serves \['other-model'\]\)",
        ):
            start_server(cfg, "ignored")
        # a model list without it fails at the first answer (issue #30), no 600 s wait
        assert len(probes) == 1
        cfg = _cfg(
            "serve.backend=external",
            f"serve.base_url=http://127.0.0.1:{port}/",
            "target.served_model_name=other-model",
        )
        with start_server(cfg, "ignored") as server:
            assert server.base_url == f"http://127.0.0.1:{port}" and not server.started_here
        assert stub.poll() is None, "the external backend must never stop what it did not start"
    finally:
        stub.kill()
        stub.wait()


def test_bad_model_path_fails_before_anything_starts(tmp_path, monkeypatch):
    from eagle3.serving import server

    def refuse(*a, **k):
        raise AssertionError("a server process was started for a model path that cannot work")

    monkeypatch.setattr(server, "ChildProcess", refuse)
    with pytest.raises(ServerError, match="model path .*/no-such-model does not exist"):
        start_server(_cfg(), str(tmp_path / "no-such-model"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ServerError, match="has no config.json"):
        start_server(_cfg(), str(tmp_path / "empty"))


def test_port_in_use_is_clear(smol_model):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(PortInUseError, match=f"port {port} on 127.0.0.1 is already in use"):
            start_server(_cfg(f"serve.port={port}"), str(smol_model))


def test_missing_vllm_env_is_clear(smol_model, tmp_path):
    with pytest.raises(ServerError, match="make vllm-env"):
        start_server(_cfg(f"serve.vllm_python={tmp_path}/nope/bin/python"), str(smol_model))


# --- GPU stages and the production unit (eagle3.serving.gpus) ---------------------------------
# The stand-in unit is a sleeping process: what is checked is which systemctl calls are made.


def _sleeping_unit(state):
    import sys

    (state / "vllm-test.cmd").write_text(
        json.dumps([sys.executable, "-c", "import time; time.sleep(600)"])
    )


def test_gpu_stage_fails_at_once_while_a_foreign_unit_holds_the_gpus(fake_systemd, tmp_path):
    import subprocess

    from eagle3.serving.gpus import GPUsBusy, release_gpus
    from eagle3.train import train

    _sleeping_unit(fake_systemd)
    assert not release_gpus(_cfg(), "train")  # process backend: nothing to check, no systemctl call
    assert not (fake_systemd / "calls.log").exists()
    cfg = _systemd_cfg(8000)
    assert not release_gpus(cfg, "train")  # the unit is not running
    subprocess.run(["systemctl", "start", "vllm-test"], check=True)  # an operator's server
    try:
        with pytest.raises(
            GPUsBusy,
            match=r"train needs the GPUs, but the systemd unit vllm-test is active.*"
            r"sudo systemctl stop vllm-test.*serve.stop_running_unit=true",
        ):
            release_gpus(cfg, "train")
        # the train stage itself refuses before reading anything (these paths do not exist)
        with pytest.raises(GPUsBusy):
            train(
                cfg,
                tmp_path / "no-extract",
                tmp_path / "no-vocab",
                tmp_path / "no-target",
                tmp_path / "out",
            )
        assert "systemctl stop vllm-test" not in _calls(fake_systemd)
    finally:
        subprocess.run(["systemctl", "stop", "vllm-test"])


def test_stop_running_unit_stops_it_for_gpu_stages_and_starts_it_again(fake_systemd):
    import subprocess

    from eagle3.serving.gpus import release_gpus, units_restored
    from eagle3.serving.systemd import active_state

    _sleeping_unit(fake_systemd)
    cfg = _systemd_cfg(8000, "serve.stop_running_unit=true")
    subprocess.run(["systemctl", "start", "vllm-test"], check=True)
    try:
        with (
            pytest.raises(RuntimeError, match="stage failed"),
            units_restored(cfg, log=lambda _m: None),
        ):
            assert release_gpus(cfg, "extract", log=lambda _m: None)
            assert active_state("vllm-test") == "inactive"
            assert not release_gpus(cfg, "train", log=lambda _m: None)  # already free
            raise RuntimeError("stage failed")  # the unit comes back on failure too
        assert _calls(fake_systemd)[-1] == "systemctl start vllm-test"
        assert active_state("vllm-test") == "active"
    finally:
        subprocess.run(["systemctl", "stop", "vllm-test"])
    n = len(_calls(fake_systemd))
    with units_restored(
        cfg, log=lambda _m: None
    ):  # not running at the start: not started at the end
        pass
    assert "systemctl start vllm-test" not in _calls(fake_systemd)[n:]


def test_extract_server_for_a_systemd_profile_is_a_process_with_the_connector(tmp_path):
    """The production unit serves without the connector: extract runs the same vLLM command itself."""
    from eagle3.extract.vllm_backend import extract_server_config
    from tests.conftest import KIMI_PROFILE

    cfg = load_config(KIMI_PROFILE)
    e = extract_server_config(cfg, tmp_path / "hidden").serve
    assert (e.backend, e.port, e.tensor_parallel_size, e.vllm_bin) == (
        "process",
        0,
        8,
        cfg.serve.vllm_bin,
    )
    assert "--kv-transfer-config" in e.extra_args and "--no-enable-prefix-caching" in e.extra_args
    assert e.extra_args[: len(cfg.serve.extra_args)] == cfg.serve.extra_args
    with pytest.raises(ValueError, match="external server"):
        extract_server_config(
            _cfg("serve.backend=external", "serve.base_url=http://127.0.0.1:9"), tmp_path
        )
