"""The GPUs of a production node are held by the target's systemd unit while it runs.

On the Kimi node the serving unit takes ~90% of the memory of all 8 GPUs, and so do the stages
after generate: extract (its own vLLM process, with the hidden-state connector the unit lacks),
train (8 ranks) and verify's speculative unit. Without a check, such a stage finds out by an
out-of-memory error minutes (vLLM) or a 22-minute model load later. So each GPU stage first calls
:func:`release_gpus`: a unit this run started is already stopped (the hero run stops its server
after generate); one that was running before (an operator's production server) is stopped only if
``serve.stop_running_unit`` allows it, and :func:`units_restored` starts it again when the run or
the CLI command ends. Other backends hold no GPUs of ours and pass through.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from eagle3.serving.systemd import RUNNING_STATES, _run, active_state


class GPUsBusy(RuntimeError):
    """A GPU stage would start while the target's systemd unit holds the GPUs."""


def release_gpus(cfg: Any, stage: str, log: Callable[[str], None] = print) -> bool:
    """Stop the target's unit before ``stage`` if allowed; True if it stopped one.

    Raises :class:`GPUsBusy` (before any GPU work) if the unit runs and may not be stopped."""
    s = cfg.serve
    if s.backend != "systemd" or not s.unit:
        return False
    state = active_state(s.unit)
    if state not in RUNNING_STATES:
        return False
    if not s.stop_running_unit:
        raise GPUsBusy(
            f"{stage} needs the GPUs, but the systemd unit {s.unit} is {state} and holds them "
            f"(it was running "
            f"before this run, so the pipeline leaves it alone). "
            f"Stop it first (sudo systemctl stop {s.unit}), "
            f"or set serve.stop_running_unit=true "
            f"to let the run stop it and start it again at the end."
        )
    log(
        f"{stage}: stopping systemd unit {s.unit} to free the GPUs (serve.stop_running_unit); "
        "it is started again when the run ends"
    )
    _run(["systemctl", "stop", s.unit], check=True)
    return True


@contextmanager
def units_restored(cfg: Any, log: Callable[[str], None] = print) -> Iterator[None]:
    """Start the target's unit again at the end if it ran at the start and a GPU stage stopped it.

    Only with ``serve.stop_running_unit``: otherwise the pipeline never stops a unit it did not
    start. Runs on failure too (``finally``). ``systemctl start`` returns once the unit is started,
    not once the model is loaded."""
    s = cfg.serve
    if (
        s.backend != "systemd"
        or not s.unit
        or not s.stop_running_unit
        or os.environ.get("RANK", "0") != "0"
    ):
        yield  # (under torchrun only rank 0 looks after the unit)
        return
    was_running = active_state(s.unit) in RUNNING_STATES
    try:
        yield
    finally:
        if was_running and active_state(s.unit) not in RUNNING_STATES:
            log(f"starting systemd unit {s.unit} again: it was running when the run began")
            _run(["systemctl", "start", s.unit])
