"""SIGTERM and SIGINT as an exception, so that whatever a command started is stopped.

Why: SIGTERM's default action ends the process at once: ``finally`` blocks, context managers
and ``atexit`` do not run, and a vLLM server the command started (its own process group) was
left running, holding its memory or GPUs (issue #16). Prefect cancelling a run, systemd
stopping a worker and ``kill`` all send SIGTERM. Raising ``Interrupted`` unwinds the stack
instead: every ``with start_server(...)`` stops its whole group, stores flush, and the CLI
then says what was saved and how to resume.

Only the main thread can install handlers; elsewhere (a Prefect worker thread) this is a no-op
and the caller's own handling (Prefect's) applies.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

from eagle3.errors import Interrupted

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
