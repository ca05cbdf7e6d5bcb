"""SIGINT/SIGTERM inside an event loop: the command's coroutine is cancelled, cleaned up, and
``Interrupted`` is raised after the loop, never logged and lost inside asyncio (the CI failure
of 2026-12-07: "Fatal write error on socket transport ... eagle3.errors.Interrupted: SIGINT"
printed with its traceback by generate)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time

import pytest

from eagle3.errors import Interrupted
from eagle3.signals import interrupts_raise, run_async


async def _signalled_from_a_callback(steps: list[str], *signums: int) -> str:
    """Sends the signals from a loop callback: a handler that raised would raise inside
    asyncio's Handle._run, which logs the exception and carries on."""
    loop = asyncio.get_running_loop()
    for s in signums:
        loop.call_soon(os.kill, os.getpid(), s)
    try:
        await asyncio.sleep(5)
        steps.append("slept")
        return "finished"
    finally:
        await asyncio.sleep(0)  # cleanup that awaits (closing a session) still runs in the loop
        steps.append("cleaned up")


def test_a_signal_inside_the_loop_cancels_the_coroutine_and_raises_interrupted(caplog):
    caplog.set_level(logging.WARNING, logger="asyncio")
    steps: list[str] = []
    before = signal.getsignal(signal.SIGINT)
    with interrupts_raise():
        with pytest.raises(Interrupted) as e:
            run_async(_signalled_from_a_callback(steps, signal.SIGINT, signal.SIGTERM))
        # once, as outside a loop: a second signal must not abort the cleanup that follows
        assert signal.getsignal(signal.SIGINT) == signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    assert e.value.signum == signal.SIGINT  # the first one; the SIGTERM after it is ignored
    assert steps == ["cleaned up"]  # cancelled in its sleep, not slept through
    assert not [
        r for r in caplog.records if r.name == "asyncio" and r.levelno >= logging.WARNING
    ], caplog.text
    assert signal.getsignal(signal.SIGINT) is before  # the caller's (pytest's), restored


def test_without_a_signal_or_outside_interrupts_raise_it_is_asyncio_run():
    async def value() -> int:
        await asyncio.sleep(0)
        return 7

    with interrupts_raise():
        assert run_async(value()) == 7
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN  # still ours, not reset
        with pytest.raises(Interrupted):  # and still raises outside a loop
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)
    assert run_async(value()) == 7
