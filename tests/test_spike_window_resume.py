"""Relaunching a run with a spike policy its checkpoint cannot resume (added
to a run trained without one, or another --spike_window) is one line naming
the setting and what to relaunch with, not a restore mismatch of "this
model and optimizer"."""

import pytest
import tensorflow as tf

import framework
from framework.errors import CheckpointError
from test_spike_policy import _batches
from test_trainer import make_trainer


def _run(model_dir, train_steps, **options):
  trainer = make_trainer("one_device", optimizer="adam", learning_rate=1e-3,
                         **options)
  x, y = _batches(spike=None, steps=train_steps + 4)

  def train_input(start):
    return tf.data.Dataset.from_tensor_slices((x[start:], y[start:]))

  config = framework.LoopConfig(train_steps=train_steps, steps_per_loop=2,
                                checkpoint_every=2)
  framework.Controller(
      trainer, config, str(model_dir), train_input=train_input,
      checkpoint_items=framework.core.checkpoints.checkpoint_items(
          trainer)).run()


@pytest.mark.parametrize("before,after,named", [
    ({}, {"spike_policy": "skip", "spike_window": 3},
     "spike_policy=skip: checkpoint .* without a spike policy"),
    ({"spike_policy": "skip", "spike_window": 3},
     {"spike_policy": "skip", "spike_window": 4},
     "spike_window=4: checkpoint .* window of 3 steps; relaunch with "
     "spike_window=3"),
])
def test_a_spike_window_the_checkpoint_lacks_is_one_line(tmp_path, before,
                                                          after, named):
  _run(tmp_path, 2, **before)
  with pytest.raises(CheckpointError, match=named) as error:
    _run(tmp_path, 4, **after)
  assert "\n" not in str(error.value)


def test_dropping_the_spike_policy_resumes(tmp_path):
  _run(tmp_path, 2, spike_policy="skip", spike_window=3)
  _run(tmp_path, 4)
