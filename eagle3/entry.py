"""How the `eagle3` command ends: one-line errors, and what was saved when it was stopped.

Why: a user who points the pipeline at a wrong URL or a bad file needs the file, field or URL and
what to do, not 200 lines of traceback (issue #16); `--debug` anywhere on the command line (or
EAGLE3_DEBUG=1) shows the traceback too. SIGTERM and SIGINT raise ``Interrupted``
(eagle3.signals), so the servers a command started are stopped on the way out; the command may
attach what it had saved (``e.saved``), printed here with how to resume. Exit codes: 1 (2 for a
configuration error), 128 + the signal number when stopped.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path
from typing import Any

import typer

from eagle3.errors import Eagle3Error, Interrupted, disk_full, is_disk_full
from eagle3.signals import interrupts_raise


def run(app: Any, args: list[str]) -> None:
    debug = "--debug" in args or os.environ.get("EAGLE3_DEBUG") == "1"
    args = [a for a in args if a != "--debug"]
    try:
        with interrupts_raise():
            app(args=args, prog_name="eagle3")
    except Interrupted as e:
        saved = getattr(e, "saved", None) or "what it had written is kept"
        typer.secho(
            f"interrupted ({e}): every server this command started was stopped; {saved}. "
            "Rerun the same "
            "command to resume.",
            fg="yellow",
            err=True,
        )
        sys.exit(128 + e.signum)
    except (Eagle3Error, OSError) as e:
        if not isinstance(e, Eagle3Error):
            if not is_disk_full(e):
                raise
            e = disk_full(Path(e.filename or os.getcwd()), None, "this stage")
        if debug:
            traceback.print_exc()
        typer.secho(f"error: {e}", fg="red", err=True)
        sys.exit(getattr(e, "exit_code", 1))
