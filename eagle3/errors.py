"""One error type per failure class, shared by every stage.

Each carries a one-line message that names the file, the field or the URL and says what to do.
The CLI prints an ``Eagle3Error`` without a traceback (``--debug`` shows one); Prefect tasks do
not retry the classes a retry cannot fix (``tasks/retries.py``). Why one module: a stage that
fails for a bad URL, bad data or a full disk must say so the same way, whichever stage it is.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path


class Eagle3Error(Exception):
    """A failure the user can act on; the message says what and what to do."""

    exit_code = 1


class ConfigError(Eagle3Error, ValueError):
    """A profile that cannot be loaded; the message names the file and the field."""

    exit_code = 2


class InputDataError(Eagle3Error, ValueError):
    """An input file (dataset, generate shard) that cannot be read; names the file (and line)."""


class DatasetNotFound(InputDataError, FileNotFoundError):
    """The dataset file does not exist (also a FileNotFoundError, as it was before)."""


class ServerError(Eagle3Error, RuntimeError):
    """The server could not be started or reached; the message says why."""


class EndpointError(ServerError):
    """A wrong URL, path or key: 404/401/403 from the server. Fatal: no sample is charged with
    it."""


class ServerUnavailable(ServerError):
    """No endpoint answers any more: the stage stops; a rerun resumes where it stopped."""


class TokenIdMismatch(Eagle3Error):
    """Token ids that do not match the local tokenizer (and chat template) or its vocabulary."""


class MissingSamples(Eagle3Error):
    """A stage read fewer samples than its input's manifest lists, with no recorded reason."""


class NoResult(Eagle3Error):
    """A stage ran but produced nothing usable (no finite training step, zero samples): nothing
    sealed."""


class CorruptArtifact(Eagle3Error):
    """A stored file (e.g. a safetensors shard) is truncated or unreadable; names the file."""


class FolderBusy(Eagle3Error):
    """Another process is writing the same stage folder (it holds the folder's writer lock); the
    message names it (pid, host, start time, command). Two writers duplicated samples (#39)."""


class OutputDirError(Eagle3Error):
    """The output folder cannot be one: an existing file, or a place that cannot be written."""


class DiskFull(Eagle3Error, OSError):
    """No space left: says where, about how much more is needed, and that a rerun resumes."""

    def __init__(self, message: str):
        Eagle3Error.__init__(self, message)
        self.errno = errno.ENOSPC

    def __str__(self) -> str:
        return str(self.args[0])


class Interrupted(BaseException):
    """SIGTERM or SIGINT: unwinds the stack (so servers stop, stores flush), then the CLI says
    what was saved. A BaseException so that ``except Exception`` blocks do not swallow it."""

    def __init__(self, signum: int):
        import signal

        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def is_disk_full(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


def disk_full(path: Path, needed_bytes: float | None, what: str = "") -> DiskFull:
    """The DiskFull error for ``path``: free space there and about how much the rest needs."""
    path = Path(path)
    probe = next((p for p in (path, *path.parents) if p.exists()), Path("/"))
    free = shutil.disk_usage(probe).free
    need = f"about {_human(needed_bytes)} more is needed for {what}, " if needed_bytes else ""
    return DiskFull(
        f"disk full writing {path} ({_human(free)} free): {need}free space there (or point "
        "paths.runs_dir elsewhere) and rerun the same command: it resumes where it stopped"
    )


__all__ = [
    "ConfigError",
    "CorruptArtifact",
    "DatasetNotFound",
    "DiskFull",
    "EndpointError",
    "Eagle3Error",
    "FolderBusy",
    "InputDataError",
    "Interrupted",
    "MissingSamples",
    "NoResult",
    "OutputDirError",
    "ServerError",
    "ServerUnavailable",
    "TokenIdMismatch",
    "disk_full",
    "is_disk_full",
]
