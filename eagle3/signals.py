"""SIGTERM and SIGINT as an exception, so that whatever a command started is stopped.

Why: SIGTERM's default action ends the process at once: ``finally`` blocks, context managers
and ``atexit`` do not run, and a vLLM server the command started (its own process group) was
left running, holding its memory or GPUs (issue #16). Prefect cancelling a run, systemd
stopping a worker and ``kill`` all send SIGTERM. Raising ``Interrupted`` unwinds the stack
instead: every ``with start_server(...)`` stops its whole group, stores flush, and the CLI
then says what was saved and how to resume.

Only the main thread can install handlers; elsewhere (a Prefect worker thread) this is a no-op
and the caller's own handling (Prefect's) applies.

Inside an event loop the exception must not be raised by the handler: asyncio catches any
BaseException but SystemExit and KeyboardInterrupt where a callback or a socket write runs, logs
it ("Fatal write error on socket transport", "Exception in callback") and goes on, so the signal
was either lost or printed with a traceback. ``run_async`` takes the signals through the loop
instead: they cancel the main task, and ``Interrupted`` is raised once the loop has closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Coroutine, Iterator
from types import FrameType
from typing import Any, TypeVar

from eagle3.errors import Interrupted

T = TypeVar("T")

SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _raise(signum: int, frame: FrameType | None) -> None:
    # Once is enough: a second signal during the cleanup would abort the stop of the server it
    # is there to protect. The stop itself is bounded (SIGTERM, then SIGKILL after
    # serve.stop_timeout_s).
    for s in SIGNALS:
        signal.signal(s, signal.SIG_IGN)
    raise Interrupted(signum)


@contextlib.contextmanager
def interrupts_raise() -> Iterator[None]:
    """Within the block, SIGTERM and SIGINT raise ``Interrupted`` (once); handlers restored
    after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in SIGNALS}
    for s in SIGNALS:
        signal.signal(s, _raise)
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)


def run_async(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)``; within ``interrupts_raise``, SIGTERM/SIGINT cancel ``main`` (its
    ``finally`` blocks run inside the loop: requests cancelled, sessions closed) and then raise
    ``Interrupted`` here, as the handler would have outside a loop."""
    if threading.current_thread() is not threading.main_thread() or not all(
        signal.getsignal(s) is _raise for s in SIGNALS
    ):
        return asyncio.run(main)
    got: list[int] = []

    async def guarded() -> T:
        loop, task = asyncio.get_running_loop(), asyncio.current_task()
        assert task is not None

        def on_signal(signum: int) -> None:
            if not got:  # once, as in _raise
                got.append(signum)
                task.cancel()

        for s in SIGNALS:
            loop.add_signal_handler(s, on_signal, s)
        try:
            return await main
        finally:
            for s in SIGNALS:  # removing resets the handler to the default: put ours back
                loop.remove_signal_handler(s)
                signal.signal(s, signal.SIG_IGN if got else _raise)

    try:
        result = asyncio.run(guarded())
    except BaseException:
        if got:  # the cancellation, or whatever it made a request raise
            raise Interrupted(got[0]) from None
        raise
    if got:  # it came as main was returning
        raise Interrupted(got[0])
    return result
