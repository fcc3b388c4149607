"""spike_policy=rollback with async_checkpoint: a spike while the last
checkpoint is still being written rolls back to that checkpoint, as the
synchronous run does, and ends with the synchronous run's weights."""

import json
import time

import numpy as np
import tensorflow as tf

import framework
from framework.core.checkpoints import manager
from test_spike_policy import _batches, _state
from test_trainer import make_trainer

STEPS, EVERY = 12, 4  # the spike (batch 6) is step 7: back to step 4


def _run(model_dir, async_checkpoint):
  trainer = make_trainer("one_device", optimizer="adam", learning_rate=1e-3,
                         spike_policy="rollback", spike_factor=5,
                         spike_window=3)
  x, y = _batches(steps=STEPS + 8)

  def train_input(start):
    return tf.data.Dataset.from_tensor_slices((x[start:], y[start:]))

  config = framework.LoopConfig(train_steps=STEPS, steps_per_loop=4,
                                checkpoint_every=EVERY,
                                async_checkpoint=async_checkpoint)
  controller = framework.Controller(
      trainer, config, str(model_dir), train_input=train_input,
      checkpoint_items=framework.core.checkpoints.checkpoint_items(trainer))
  controller.run()
  record = json.loads((model_dir / "spike_batches.json").read_text())
  return _state(trainer), record["rollbacks"]


def test_a_spike_during_a_background_write_rolls_back_to_it(tmp_path):
  def slow_write(prefix):
    if prefix.endswith("ckpt-4"):
      time.sleep(1.5)  # still in flight when steps 5..8 (the spike) end

  manager._WRITE_HOOKS.append(slow_write)
  try:
    background, rollbacks = _run(tmp_path / "async", True)
  finally:
    manager._WRITE_HOOKS.remove(slow_write)
  synchronous, expected = _run(tmp_path / "sync", False)
  assert expected == [{"spike_step": 7, "checkpoint_step": 4,
                       "batches": [4, 5, 6]}]
  assert rollbacks == expected
  for a, b in zip(background, synchronous):
    np.testing.assert_array_equal(a, b)
