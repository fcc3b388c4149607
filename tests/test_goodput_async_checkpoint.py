"""Goodput under async_checkpoint: the steps up to a background write count
only once it landed; a write that never lands (a kill -9, a full disk)
leaves them pending, and the relaunch that trains them again counts them
as lost_steps, as with synchronous saves."""

import errno
import json

import pytest
import tensorflow as tf

import framework
from framework.core import goodput
from framework.core.checkpoints import manager
from framework.errors import ModelDirError
from test_spike_policy import _batches
from test_trainer import make_trainer


def _run(model_dir, train_steps):
  trainer = make_trainer("one_device", optimizer="adam", learning_rate=1e-3)
  x, y = _batches(spike=None, steps=train_steps + 4)

  def train_input(start):
    return tf.data.Dataset.from_tensor_slices((x[start:], y[start:]))

  config = framework.LoopConfig(train_steps=train_steps, steps_per_loop=2,
                                checkpoint_every=2, async_checkpoint=True)
  framework.Controller(
      trainer, config, str(model_dir), train_input=train_input,
      checkpoint_items=framework.core.checkpoints.checkpoint_items(
          trainer)).run()


def test_a_write_that_never_landed_is_lost_steps_after_the_relaunch(
    tmp_path):
  def full_disk(prefix):
    if prefix.endswith("ckpt-4"):
      raise OSError(errno.ENOSPC, "No space left on device")

  manager._WRITE_HOOKS.append(full_disk)
  try:
    with pytest.raises(ModelDirError):
      _run(tmp_path, 8)
  finally:
    manager._WRITE_HOOKS.remove(full_disk)
  record = json.loads((tmp_path / goodput.GOODPUT_FILE).read_text())
  assert [entry[:2] for entry in record["pending"]] == [[3, 4]]
  _run(tmp_path, 8)  # resumes from ckpt-2: steps 3 and 4 train again
  record = json.loads((tmp_path / goodput.GOODPUT_FILE).read_text())
  assert record["lost_step_counts"] == {"lost_steps": 2}
  assert record["launches"] == 2 and record["pending"] == []
