"""Retry and timeout settings of the stage tasks, in one place.

Retries are for transient trouble (a server that stopped answering, a killed worker, a full
disk that was cleaned): every stage resumes, so a retry only redoes what is missing (generate
requests the prompts not yet answered or failed, extract skips stored samples, train continues
from its last checkpoint). A wrong setting or bad data fails the same way every time, so those
errors are not retried: the run fails at once with the message.

Timeouts are generous ceilings for the production profile (a 1T target on 8 GPUs), there to
turn a hung stage into a failure that a rerun resumes, not to bound normal work.
"""

from __future__ import annotations

from typing import Any

HOUR = 3600.0
TIMEOUT_S = {
    "prepare-model": 1 * HOUR,
    "serve": 2 * HOUR,  # start and wait: the serve backend's own ready timeout fires first
    "generate": 48 * HOUR,
    "extract": 48 * HOUR,
    "vocab": 2 * HOUR,
    "train": 96 * HOUR,
    "verify": 8 * HOUR,
    "stage": 48 * HOUR,  # a registry stage without a task module of its own (tasks/stage.py)
}


def non_retriable() -> tuple[type[BaseException], ...]:
    """Errors that a retry cannot fix (configuration, data, a diverged run, a failed gate, GPUs held
    by a unit the run may not stop)."""
    from eagle3.config import ConfigError
    from eagle3.embedded import EmbeddedModelError
    from eagle3.errors import (
        CorruptArtifact,
        EndpointError,
        InputDataError,
        MissingSamples,
        NoResult,
        OutputDirError,
        TokenIdMismatch,
    )
    from eagle3.extract.runner import TokenizerMismatch
    from eagle3.input_checks import TargetUnavailable
    from eagle3.serving.gpus import GPUsBusy
    from eagle3.train import TrainingDiverged

    out: list[type[BaseException]] = [
        ValueError,
        KeyError,
        TypeError,
        FileNotFoundError,
        ConfigError,
        EmbeddedModelError,
        TokenizerMismatch,
        TrainingDiverged,
        GPUsBusy,
        EndpointError,
        InputDataError,
        MissingSamples,
        NoResult,
        TokenIdMismatch,
        CorruptArtifact,
        OutputDirError,  # FolderBusy is retried: the other writer may have finished
        TargetUnavailable,
    ]
    try:
        from eagle3.verify import GateFailed

        out.append(GateFailed)
    except ImportError:
        pass
    return tuple(out)


def transient_only(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect ``retry_condition_fn``: retry unless the failure is one a retry cannot fix."""
    try:
        state.result()
    except non_retriable():
        return False
    except BaseException:  # noqa: BLE001 - anything else may be transient
        return True
    return True
