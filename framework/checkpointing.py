"""Checkpoints that resume exactly and are safe with several workers.

Every worker must take part in a multi-worker save (the save is a collective);
only the chief's copy is kept, the others write to a temporary directory that
is removed straight after. A checkpoint that cannot be restored is an error,
never a silent restart from scratch.
"""

import glob
import os
import shutil

from absl import logging
import tensorflow as tf

from framework import strategies
from framework.errors import CheckpointError, check_positive

_WORKER_TMP = ".tmp_worker_"


def _first_line(error):
  text = str(error).strip().splitlines()
  return text[0] if text else type(error).__name__


class CheckpointManager:
  """Saves and restores `checkpoint` in `model_dir` (chief) or a temp dir.

  Args:
    checkpoint: a `tf.train.Checkpoint` (model, optimizer, global step, ...).
    model_dir: where the chief's `ckpt-<step>` files live.
    strategy: decides chief versus other workers.
    max_to_keep: how many of the newest checkpoints to keep.
  """

  def __init__(self, checkpoint, model_dir, strategy, *, max_to_keep=3):
    check_positive("keep_checkpoints", max_to_keep)
    self.checkpoint = checkpoint
    self.model_dir = model_dir
    self.is_chief = strategies.is_chief(strategy)
    if self.is_chief:
      self.directory = model_dir
    else:
      task_type, task_id = strategies.task_info(strategy)
      self.directory = os.path.join(model_dir,
                                    f"{_WORKER_TMP}{task_type}_{task_id}")
    tf.io.gfile.makedirs(self.directory)
    if self.is_chief:
      self.clean_orphans()
    self._check_state_file()
    self.manager = tf.train.CheckpointManager(
        checkpoint, self.directory, max_to_keep=max_to_keep,
        checkpoint_name="ckpt")

  def clean_orphans(self):
    """Removes temporary directories left by a save that was killed."""
    patterns = [os.path.join(self.model_dir, "*_temp"),
                os.path.join(self.model_dir, "*_temp_*"),
                os.path.join(self.model_dir, _WORKER_TMP + "*")]
    for path in sorted({p for pattern in patterns for p in glob.glob(pattern)}):
      logging.info("Removing orphaned temporary checkpoint data %s", path)
      if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
      else:
        os.remove(path)

  def _check_state_file(self):
    if not self.is_chief:
      return
    has_data = glob.glob(os.path.join(self.directory, "ckpt-*.index"))
    try:
      state = tf.train.get_checkpoint_state(self.directory)
    except Exception as e:  # a corrupt text proto raises a parse error
      raise CheckpointError(
          f"the checkpoint state file {self.directory}/checkpoint is corrupt "
          f"({_first_line(e)}); ckpt-* files exist, so refusing to start from "
          "scratch: fix or delete the state file") from None
    if has_data and (state is None or not state.model_checkpoint_path):
      raise CheckpointError(
          f"{self.directory} holds ckpt-* files but its 'checkpoint' state "
          "file is missing or empty; refusing to start from scratch: restore "
          "the state file or move the ckpt-* files away")

  @property
  def latest(self):
    return self.manager.latest_checkpoint if self.is_chief else None

  def restore_latest(self, path=None):
    """Restores `path` (default: the chief's latest); returns it or None."""
    path = path or tf.train.latest_checkpoint(self.model_dir)
    if path is None:
      return None
    try:
      status = self.checkpoint.restore(path)
      status.assert_existing_objects_matched()
    except (ValueError, AssertionError, tf.errors.OpError) as e:
      raise CheckpointError(
          f"checkpoint {path} does not match this model and optimizer "
          f"({_first_line(e)}); use another model_dir or the same model "
          "flags") from None
    logging.info("Restored checkpoint %s", path)
    return path

  def save(self, step):
    """Saves at `step`; every worker must call this (it is a collective)."""
    path = self.manager.save(checkpoint_number=step)
    if not self.is_chief:
      shutil.rmtree(self.directory, ignore_errors=True)
      return None
    logging.info("Saved checkpoint %s", path)
    return path
