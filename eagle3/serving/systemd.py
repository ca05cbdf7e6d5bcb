"""The `systemd` backend: production servers are units, not children of the pipeline.

A Kimi-K2.5 load takes ~22 minutes on 8 GPUs; the server must survive a pipeline crash or
a worker restart, and operators already manage it with systemctl/journalctl. We start the
unit only if it is not already running, watch it while waiting for readiness (a failed unit
or a restart loop is reported at once with the journal's last lines) and stop it at
teardown only if we started it.
"""

from __future__ import annotations

import subprocess

from eagle3.serving.readiness import ServerDiedError, ServerError

RUNNING_STATES = {"active", "activating", "reloading"}


def _run(argv: list[str], check: bool = False) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=120, check=check)
    except FileNotFoundError:
        raise ServerError(
            f"{argv[0]} not found: the systemd backend needs systemd on this machine"
        ) from None
    except subprocess.CalledProcessError as e:
        raise ServerError(
            f"{' '.join(argv)} failed ({e.returncode}): {e.stderr.strip() or e.stdout.strip()}"
        ) from None


def active_state(unit: str) -> str:
    return _run(["systemctl", "is-active", unit]).stdout.strip() or "unknown"


def restarts(unit: str) -> int:
    out = _run(["systemctl", "show", "-p", "NRestarts", "--value", unit]).stdout.strip()
    return int(out) if out.isdigit() else 0


def journal(unit: str, lines: int = 50) -> str:
    r = _run(["journalctl", "-u", unit, "-n", str(lines), "--no-pager"])
    return (r.stdout or r.stderr).rstrip()


class SystemdUnit:
    def __init__(self, unit: str):
        self.unit = unit
        self.started_here = False
        self._restarts_at_start = 0

    def start(self) -> None:
        state = active_state(self.unit)
        if state in RUNNING_STATES:
            return  # someone else runs it: use it, never stop it
        self._restarts_at_start = restarts(self.unit)
        _run(["systemctl", "start", self.unit], check=True)
        self.started_here = True

    def check_alive(self) -> None:
        state = active_state(self.unit)
        n = restarts(self.unit)
        if state not in RUNNING_STATES or n > self._restarts_at_start:
            why = f"state {state!r}" + (
                f", restarted {n - self._restarts_at_start}x" if n > self._restarts_at_start else ""
            )
            raise ServerDiedError(
                f"systemd unit {self.unit} died before it was ready ({why}).\n"
                f"--- journalctl -u {self.unit} -n 50 ---\n{journal(self.unit)}"
            )

    def stop(self) -> None:
        if self.started_here:
            _run(["systemctl", "stop", self.unit])
            self.started_here = False
