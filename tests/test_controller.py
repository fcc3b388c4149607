"""The Controller built directly, as a user would: any Keras optimizer, any
metric names, a plain tf.data.Dataset, under MirroredStrategy (2 CPUs)."""

import dataclasses
import glob
import os
import time

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorboard.backend.event_processing import event_accumulator

import framework
from framework.core.controller import Controller, LoopConfig
from shared_strategy import mirrored

BATCH = 8
STEPS = 6  # per half of the interrupted run


class RegressionTrainer(framework.Trainer):
  """Mean squared error; reports `loss` and `mae`, no `accuracy`."""

  def train_step(self, batch):
    x, y = batch
    with tf.GradientTape() as tape:
      error = self.model(x, training=True)[:, 0] - y
      loss = self.average(tf.square(error))
    grads = self.all_reduce(tape.gradient(loss,
                                          self.model.trainable_variables))
    self.apply_gradients(grads)
    return {"loss": loss, "mae": self.average(tf.abs(error))}

  def eval_step(self, batch):
    x, y = batch
    error = self.model(x, training=False)[:, 0] - y
    return {"loss": tf.reduce_sum(tf.square(error)),
            "mae": tf.reduce_sum(tf.abs(error)),
            "examples": tf.cast(tf.shape(y)[0], tf.float32)}


def _data():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(40, 3)).astype(np.float32)
  y = (x @ np.array([1.0, -2.0, 0.5], np.float32) + 0.3).astype(np.float32)
  return tf.data.Dataset.from_tensor_slices((x, y))


def train_input(start_step):
  # The contract: the function skips what the run already consumed.
  return _data().repeat().batch(BATCH, drop_remainder=True).skip(start_step)


def eval_input():
  return _data().batch(BATCH)


def make_controller(model_dir, train_steps,
                    make_optimizer=lambda: keras.optimizers.Adam(1e-2),
                    **kwargs):
  strategy = mirrored()
  keras.utils.set_random_seed(0)
  with strategy.scope():
    inputs = keras.Input((3,))
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(1)(hidden))
    # A plain optimizer: its learning rate is a MirroredVariable here.
    optimizer = make_optimizer()
  trainer = RegressionTrainer(model, optimizer, strategy,
                              global_batch_size=BATCH)
  loop = LoopConfig(train_steps=train_steps, steps_per_loop=4,
                    checkpoint_every=STEPS, summary_every=2, log_every=2)
  kwargs.setdefault("train_input", train_input)
  kwargs.setdefault("eval_input", eval_input)
  return Controller(trainer, loop, str(model_dir), **kwargs)


def scalars(logdir, tag):
  acc = event_accumulator.EventAccumulator(
      logdir, size_guidance={event_accumulator.TENSORS: 0})
  acc.Reload()
  return {e.step: float(tf.make_ndarray(e.tensor_proto))
          for e in acc.Tensors(tag)}


def test_trains_resumes_exactly_and_logs_its_own_metrics(tmp_path):
  straight = make_controller(tmp_path / "straight", 2 * STEPS)
  results = straight.run()
  assert set(results) == {"loss", "mae", "examples"}
  assert results["examples"] == 40

  first = make_controller(tmp_path / "resumed", STEPS)
  first.run()
  assert first.step == STEPS
  second = make_controller(tmp_path / "resumed", 2 * STEPS)
  second.run()
  assert second.step == 2 * STEPS
  for a, b in zip(straight.trainer.model.get_weights(),
                  second.trainer.model.get_weights()):
    np.testing.assert_array_equal(a, b)
  # Training changed the weights (the comparison above is not vacuous).
  fresh = make_controller(tmp_path / "fresh", 1).trainer.model.get_weights()
  assert not np.array_equal(fresh[0], straight.trainer.model.get_weights()[0])

  train_dir = str(tmp_path / "straight" / "train")
  mae = scalars(train_dir, "mae")
  loss = scalars(train_dir, "loss")
  assert sorted(mae) == [2, 4, 6, 8, 10, 12]
  assert loss[12] < loss[2] and 0 < mae[12] < mae[2]
  assert scalars(train_dir, "learning_rate")[12] == pytest.approx(1e-2)
  eval_mae = scalars(str(tmp_path / "straight" / "eval"), "mae")
  assert eval_mae[12] == pytest.approx(results["mae"], rel=1e-5)
  assert glob.glob(str(tmp_path / "resumed" / "ckpt-6*"))


def test_schedule_learning_rate_is_logged(tmp_path):
  schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 4, 0.5)
  controller = make_controller(
      tmp_path, 4, make_optimizer=lambda: keras.optimizers.SGD(schedule),
      eval_input=None)
  controller.run()
  lr = scalars(os.path.join(str(tmp_path), "train"), "learning_rate")
  assert lr[4] == pytest.approx(0.05)  # evaluated at the optimizer's step


def test_partial_batch_is_a_data_error(tmp_path):
  # Static shape: known before training.
  controller = make_controller(
      tmp_path / "static",  4,
      train_input=lambda s: _data().repeat().batch(6, drop_remainder=True))
  with pytest.raises(framework.DataError, match="global_batch_size=8"):
    controller.run()
  # Unknown leading dimension: checked on each batch (40 = 5 x 8 would fit;
  # 36 examples end in a batch of 4).
  controller = make_controller(
      tmp_path / "dynamic", 6,
      train_input=lambda s: _data().take(36).batch(BATCH).repeat())
  with pytest.raises(framework.DataError,
                     match="batch of 4 examples.*global_batch_size=8"):
    controller.run()


def test_each_evaluation_records_its_seconds_since_the_start(tmp_path):
  controller = make_controller(tmp_path, 12)
  controller.config = dataclasses.replace(controller.config, eval_every=4)
  # The origin is `start_time` (experiment.run sets its own start there).
  before = time.time()
  controller.start_time = before - 1000
  controller.run()
  after = time.time()
  elapsed = scalars(str(tmp_path / "eval"), "elapsed_seconds")
  assert sorted(elapsed) == [4, 8, 12]
  values = [elapsed[s] for s in (4, 8, 12)]
  assert values == sorted(values)
  assert 1000 <= values[0] and values[-1] <= after - before + 1000
  # Outside run(): no start time, no elapsed_seconds (a fresh controller
  # restores step 12 and writes its evaluation there).
  make_controller(tmp_path, 12).evaluate()
  acc = event_accumulator.EventAccumulator(str(tmp_path / "eval"))
  acc.Reload()
  assert [e.step for e in acc.Tensors("mae")] == [4, 8, 12, 12]
  assert len(acc.Tensors("elapsed_seconds")) == 3
