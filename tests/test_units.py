"""systemd unit files: the committed production unit matches its profile and is valid.

`systemd-analyze verify` is used when it runs on this machine; the CI machines have no
systemd, so the same checks are made by parsing (eagle3.serving.units.validate_unit).
"""

import json
import shutil
import subprocess

import pytest

from eagle3.config import load_config
from eagle3.serving.command import vllm_command
from eagle3.serving.units import exec_start_argv, parse_unit, render_unit, validate_unit
from tests.conftest import KIMI_PROFILE, ROOT

UNITS = ROOT / "deploy" / "systemd"


def test_kimi_unit_is_rendered_from_its_profile():
    cfg = load_config(KIMI_PROFILE)
    committed = (UNITS / "vllm-kimi-k25-int4.service").read_text()
    assert committed == render_unit(cfg), (
        "regenerate: eagle3 render-unit -c configs/kimi-k25-hero.yaml -o ..."
    )


def test_kimi_speculative_unit_serves_the_candidate_link():
    """verify's second server: the same command plus --speculative-config naming the candidate link."""
    cfg = load_config(KIMI_PROFILE)
    committed = (UNITS / "vllm-kimi-k25-int4-eagle3.service").read_text()
    assert committed == render_unit(cfg, speculative=True), (
        "regenerate: eagle3 render-unit --speculative ..."
    )
    argv = exec_start_argv(UNITS / "vllm-kimi-k25-int4-eagle3.service")
    base = vllm_command(
        cfg.serve, cfg.target.model, cfg.target.served_model_name, trust_remote_code=True
    )
    i = argv.index("--speculative-config")
    assert argv[:i] + argv[i + 2 :] == base
    assert json.loads(argv[i + 1]) == {
        "method": "eagle3",
        "model": cfg.verify.candidate_link,
        "num_speculative_tokens": cfg.verify.num_speculative_tokens,
    }


def test_kimi_unit_runs_the_production_command():
    argv = exec_start_argv(UNITS / "vllm-kimi-k25-int4.service")
    cfg = load_config(KIMI_PROFILE)
    assert argv == vllm_command(
        cfg.serve, cfg.target.model, cfg.target.served_model_name, trust_remote_code=True
    )
    assert argv[:3] == ["/opt/vllm/bin/vllm", "serve", "moonshotai/Kimi-K2.5"]
    for flag, value in [
        ("--tensor-parallel-size", "8"),
        ("--reasoning-parser", "kimi_k2"),
        ("--host", "127.0.0.1"),
    ]:
        assert argv[argv.index(flag) + 1] == value
    assert "--trust-remote-code" in argv


@pytest.mark.parametrize(
    "name", ["vllm-kimi-k25-int4.service", "vllm-kimi-k25-int4-eagle3.service", "vllm@.service"]
)
def test_units_validate(name):
    text = (UNITS / name).read_text()
    assert validate_unit(text, min_start_timeout_s=45 * 60) == []
    svc = parse_unit(text)["Service"]
    assert svc["Restart"] == ["on-failure"] and svc["KillMode"] == ["control-group"]
    assert any(v.lstrip("-").startswith("/etc/eagle3/") for v in svc["EnvironmentFile"])


@pytest.mark.skipif(
    shutil.which("systemd-analyze") is None, reason="no systemd-analyze on this machine"
)
@pytest.mark.parametrize(
    "name, as_name",
    [
        ("vllm-kimi-k25-int4.service", None),
        ("vllm-kimi-k25-int4-eagle3.service", None),
        ("vllm@.service", "vllm@demo.service"),
    ],
)
def test_systemd_analyze_verify(tmp_path, name, as_name):
    unit = tmp_path / (as_name or name)
    unit.write_text((UNITS / name).read_text())
    r = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True)
    # /opt/vllm is not installed on a test machine: that line is expected, nothing else is.
    other = [
        ln
        for ln in (r.stdout + r.stderr).splitlines()
        if ln.strip() and "/opt/vllm/bin/vllm is not executable" not in ln
    ]
    assert other == [], "\n".join(other)


def test_validator_catches_problems():
    bad = "[Unit]\nDescription=x\n[Service]\nExecStart=vllm serve m --host 0.0.0.0\nTimeoutStartSec=90\nRestart=no\n"
    problems = "\n".join(validate_unit(bad, min_start_timeout_s=2700))
    for expected in [
        "missing [Install]",
        "absolute path",
        "beyond loopback",
        "TimeoutStartSec below",
        "Restart=no",
        "[Unit] missing After=",
    ]:
        assert expected in problems
    assert validate_unit("[Service]\nExecStart=/bin/x \\\n") == [
        "unit ends inside a continuation line"
    ]
