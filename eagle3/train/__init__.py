"""The train stage: the EAGLE-3 draft trained on stored target hidden states, then exported.

Read in this order:

- :mod:`~eagle3.train.loop`: :func:`train`, the stage, top to bottom.
- :mod:`~eagle3.train.target`: the target's distribution over the draft vocab (its final norm and
  lm_head read from its checkpoint), and the optional warm start of the draft's read-out.
- :mod:`~eagle3.train.batch`: padding, and the shift of each TTT step.
- :mod:`~eagle3.train.loader`: the fast step's batches from the shards (padded a step ahead on a
  host thread, the target's argmax kept per sample); :mod:`~eagle3.train.device_data`: every
  sample in the device's memory instead.
- :mod:`~eagle3.train.ttt`: the unrolled draft, its attention mask and loss (the exact alignment).
- :mod:`~eagle3.train.ttt_fast`: the same unroll and loss without the waste (the default step).
- :mod:`~eagle3.train.optim`: AdamW or Muon + AdamW, and the LR schedule.
- :mod:`~eagle3.train.step`: one optimizer step (reference);
  :mod:`~eagle3.train.step_fast`: the step with no host sync.
- :mod:`~eagle3.train.progress`: counting steps (the NaN guard), one step in flight.
- :mod:`~eagle3.train.distributed`: torchrun, DDP / FSDP.
- :mod:`~eagle3.train.checkpoint`: save and exact resume (safetensors + JSON, no pickle).
- :mod:`~eagle3.train.metrics`: per-epoch loss and top-1, ``metrics.json`` / ``metrics.png``.
- :mod:`~eagle3.train.launch`: torchrun started from a single-process caller (not imported here:
  it is run as ``python -m eagle3.train.launch``).
"""

from eagle3.train.batch import (
    Batch,
    add_feature_noise,
    make_batch,
    shift_left,
    step_inputs,
    zero_weight,
)
from eagle3.train.checkpoint import TrainState, load_checkpoint, save_checkpoint
from eagle3.train.distributed import Dist, hold_frozen_bf16, init_distributed, wrap_for_training
from eagle3.train.loop import train
from eagle3.train.optim import lr_at, make_optimizer
from eagle3.train.progress import (
    MAX_CONSECUTIVE_NAN,
    MIN_FINITE_FRACTION,
    TrainingDiverged,
    check_finite,
)
from eagle3.train.step import StepResult, train_step
from eagle3.train.target import (
    TargetHead,
    init_head_from_target,
    load_target_head,
    target_distribution,
)
from eagle3.train.ttt import TTTObjective, step_counts, ttt_loss, ttt_mask, ttt_unroll

__all__ = [
    "MAX_CONSECUTIVE_NAN",
    "MIN_FINITE_FRACTION",
    "Batch",
    "Dist",
    "StepResult",
    "TTTObjective",
    "TargetHead",
    "TrainState",
    "TrainingDiverged",
    "add_feature_noise",
    "check_finite",
    "hold_frozen_bf16",
    "init_distributed",
    "init_head_from_target",
    "load_checkpoint",
    "load_target_head",
    "lr_at",
    "make_batch",
    "make_optimizer",
    "save_checkpoint",
    "shift_left",
    "step_counts",
    "step_inputs",
    "target_distribution",
    "train",
    "train_step",
    "ttt_loss",
    "ttt_mask",
    "ttt_unroll",
    "wrap_for_training",
    "zero_weight",
]
