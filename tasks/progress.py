"""A Prefect progress artifact updated at most every few seconds: stages report progress per
sample or per step, and one API call each would flood the Prefect server."""

from __future__ import annotations

import time

from prefect.artifacts import create_progress_artifact, update_progress_artifact


class ThrottledProgress:
    """``key``'s progress artifact; :meth:`update` writes a percentage when ``every_s`` seconds
    have passed since the last write (or when forced) and says whether it did."""

    def __init__(self, key: str, description: str, every_s: float = 5.0) -> None:
        self.artifact = create_progress_artifact(0.0, key=key, description=description)
        self.every_s = every_s
        self.last = 0.0

    def update(self, percent: float, force: bool = False) -> bool:
        if not force and time.monotonic() - self.last <= self.every_s:
            return False
        self.last = time.monotonic()
        update_progress_artifact(self.artifact, min(100.0, percent))
        return True

    def done(self) -> None:
        self.update(100.0, force=True)
