"""A gpt split's checkpoint from before cross-mesh resume: the same split
resumes it exactly; any other split is refused in one line.

distloop before cross-mesh resume (before commit 54c2082) saved a
transformer tensor split's optimizer under the split optimizer's own keys
and shapes, and recorded the split model's fingerprint in run_config.json
(now: the unsplit model's, see `split_change`). Relaunched on the same
split, such a checkpoint is restored as that split's (weights and
optimizer slots; every value it holds must be consumed) and the old
fingerprint is accepted; the run's next checkpoint is in the unsplit
layout, so from then on it resumes on any mesh. On another split (or none)
the run stops before anything is restored or written: its optimizer
state cannot be read there.
"""

import contextlib

from absl import logging
import tensorflow as tf

from framework.app import export, split_change
from framework.core import protocols
from framework.core.checkpoints import manager
from framework.errors import ConfigError
from framework.model_parallel import split_layout


def _written_by_split(previous_info, saved, unsplit_fingerprint):
  """Whether the checkpoints' run_config.json and model_info.json say a
  tensor split wrote them before cross-mesh resume: not the unsplit
  model's fingerprint."""
  was = ((previous_info or {}).get("run_plan") or {}).get("model_parallel")
  fingerprint = (saved or {}).get("model_fingerprint")
  return ((was or {}).get("mode") == "tensor" and fingerprint is not None
          and fingerprint != unsplit_fingerprint)


@contextlib.contextmanager
def restoring(trainer, checkpoints, previous_info, record, *, whole_split):
  """Around the run's first restore (`controller.restore()`).

  Args:
    trainer: the run's trainer.
    checkpoints: its `CheckpointManager` (with a checkpoint to restore).
    previous_info: the model_dir's model_info.json.
    record: this run's run_plan `model_parallel` record.
    whole_split: whether the model has a whole-model split (`gpt`).

  Raises:
    ConfigError: the checkpoint is an older tensor split's own and this run
      is not that split (the same split flags, model and shapes).
  """
  path = checkpoints.latest
  unsplit = protocols.unsplit_model(trainer)
  saved = manager.read_run_config(checkpoints.model_dir)
  if not (whole_split and path and _written_by_split(
      previous_info, saved, export.model_fingerprint(unsplit))):
    yield
    return
  was, now = (previous_info["run_plan"]["model_parallel"], record)
  old = split_change.describe(was)
  if split_change.changed_flags(was, now):
    raise ConfigError(
        f"checkpoint {path} predates resuming on another mesh: distloop "
        f"saved its optimizer under the keys of its own split ({old}), "
        f"which this split ({split_change.describe(now)}) cannot read; "
        f"resume it with {old} first (its next checkpoint resumes on any "
        "mesh), or use another model_dir")
  layout = getattr(trainer, "checkpoint_layout", None)
  split_fingerprint = export.model_fingerprint(trainer.model)
  if (layout is None or saved["model_fingerprint"] != split_fingerprint
      or layout.layout_of(tf.train.load_checkpoint(path),
                          written_as_split=True) != split_layout.SPLIT):
    raise ConfigError(
        f"checkpoint {path} (saved by distloop before cross-mesh resume, "
        f"split {old}) does not match this run's model or optimizer on the "
        f"same split (model_fingerprint was {saved['model_fingerprint']}, "
        f"now {split_fingerprint}; an optimizer state sharded across the "
        "data axis, --shard_optimizer_state, cannot read it either); use "
        "the same flags as its run or another model_dir")
  logging.warning(
      "checkpoint %s predates resuming on another mesh (its optimizer is "
      "saved as split %s's own): restoring it as this split's; the next "
      "checkpoint is saved as an unsplit run's and resumes on any mesh",
      path, old)
  with checkpoints.restoring_older(model_fingerprint=split_fingerprint), \
      layout.restoring_split():
    yield
