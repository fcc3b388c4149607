"""nan_policy=skip changes nothing on a skipped step, counts it, and gives up
after max_skipped_steps in a row; request_stop ends a running loop early."""

import threading
import time

import numpy as np
import pytest
import tensorflow as tf

import framework
import framework.data.datasets  # noqa: F401  (the attribute chain below)
import framework.data.inputs  # noqa: F401  (the attribute chain below)
from framework.errors import ConfigError
from test_trainer import GLOBAL_BATCH, make_trainer


class NanGradientsTrainer(framework.Trainer):
  """The gradient is NaN on the 0-based global steps in `bad_steps` (the
  loss stays finite): such a step must be skipped."""

  bad_steps = ()

  def compute_gradients(self, batch):
    grads, metrics = super().compute_gradients(batch)
    bad = tf.reduce_any(tf.equal(tf.constant(self.bad_steps, tf.int64),
                                 self.global_step))
    nan = tf.where(bad, np.nan, 0.0)
    return [g + nan for g in grads], metrics


@pytest.fixture(scope="module")
def data():
  return framework.data.datasets.synthetic(num_train=256, num_test=37, image_shape=(4, 4, 3),
                             seed=1)


def _iterator(trainer, data):
  return iter(framework.data.inputs.distribute_train(trainer.strategy, data,
                                         GLOBAL_BATCH, seed=3))


def _state(trainer):
  return ([v.numpy() for v in trainer.model.trainable_variables],
          int(trainer.optimizer.iterations.numpy()),
          int(trainer.global_step.numpy()),
          int(trainer.skipped_steps.numpy()),
          int(trainer.consecutive_skips.numpy()))


@pytest.mark.parametrize("strategy", ["mirrored", "one_device"])
def test_skipped_steps_change_nothing_and_are_counted(data, strategy):
  NanGradientsTrainer.bad_steps = (2, 3)
  trainer = make_trainer(strategy, trainer_cls=NanGradientsTrainer,
                         nan_policy="skip")
  iterator = _iterator(trainer, data)
  trainer.train(iterator, 2)
  weights, iterations, step, skipped, in_a_row = _state(trainer)
  assert (iterations, step, skipped, in_a_row) == (2, 2, 0, 0)
  trainer.train(iterator, 2)  # both steps skipped
  after, iterations, step, skipped, in_a_row = _state(trainer)
  for before_skip, after_skip in zip(weights, after):
    np.testing.assert_array_equal(before_skip, after_skip)
  assert (iterations, step, skipped, in_a_row) == (2, 4, 2, 2)
  trainer.train(iterator, 1)  # a good step applies and ends the streak
  after, iterations, step, skipped, in_a_row = _state(trainer)
  assert not np.array_equal(weights[0], after[0])
  assert all(np.isfinite(w).all() for w in after)
  assert (iterations, step, skipped, in_a_row) == (3, 5, 2, 0)


def test_loop_stops_after_max_skipped_steps_in_a_row(data):
  NanGradientsTrainer.bad_steps = tuple(range(3, 100))
  trainer = make_trainer("mirrored", trainer_cls=NanGradientsTrainer,
                         nan_policy="skip", max_skipped_steps=4)
  metrics = trainer.train(_iterator(trainer, data), 50)
  _, iterations, step, skipped, in_a_row = _state(trainer)
  # 3 good steps, then exactly 4 skipped ones: the loop stopped there.
  assert (iterations, step, skipped, in_a_row) == (3, 7, 4, 4)
  assert np.isfinite(float(metrics["loss"]))


@pytest.mark.parametrize("value", [0, -1, 2.5, True])
def test_max_skipped_steps_must_be_a_positive_integer(value):
  with pytest.raises(ConfigError, match=f"max_skipped_steps={value!r}"):
    make_trainer("one_device", nan_policy="skip", max_skipped_steps=value)


def test_request_stop_from_another_thread_ends_a_running_loop(data):
  trainer = make_trainer("mirrored")
  requested_at = []

  def stop_once_running():
    while int(trainer.global_step.numpy()) < 20:
      time.sleep(0.01)
    requested_at.append(int(trainer.global_step.numpy()))
    trainer.request_stop()

  thread = threading.Thread(target=stop_once_running, daemon=True)
  thread.start()
  num_steps = 20000
  metrics = trainer.train(_iterator(trainer, data), num_steps)
  thread.join(timeout=60)
  step = int(trainer.global_step.numpy())
  # It ended at a step boundary soon after the request, not at num_steps.
  assert requested_at and requested_at[0] <= step < num_steps
  assert int(trainer.optimizer.iterations.numpy()) == step
  assert np.isfinite(float(metrics["loss"]))
  # A stopped trainer runs one step per call (the first always runs).
  trainer.train(_iterator(trainer, data), 10)
  assert int(trainer.global_step.numpy()) == step + 1
