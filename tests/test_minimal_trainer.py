"""The loop contract, Orbit-sized: a trainer of about 30 lines that has only
the calls the Controller makes (`train`, `sync_replica_state`, `evaluate`),
handed its `LoopParts` and checkpoint manager, runs through
`Controller.run()` with checkpoints, evaluation and TensorBoard; a recording
proxy sees the Controller touch nothing else of it."""

import os

import keras
import numpy as np
import tensorflow as tf
from tensorboard.backend.event_processing import event_accumulator

import framework
from framework.core import checkpoints
from framework.core.controller import LoopParts, loop_parts
from test_trainer_contract import recording


class TinyTrainer:
  """Its own tf.function step on one device; mean squared error."""

  def __init__(self, model, optimizer, global_step):
    self.model, self.optimizer = model, optimizer
    self.global_step = global_step

  @tf.function
  def _step(self, x, y):
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(tf.square(self.model(x, training=True)[:, 0] - y))
    variables = self.model.trainable_variables
    self.optimizer.apply_gradients(zip(tape.gradient(loss, variables),
                                       variables))
    self.global_step.assign_add(1)
    return loss

  def train(self, iterator, num_steps):
    losses = [self._step(*next(iterator)) for _ in range(num_steps)]
    return {"loss": tf.reduce_mean(losses)}

  def sync_replica_state(self):
    pass

  def evaluate(self, dataset):
    errors = [tf.square(self.model(x)[:, 0] - y) for x, y in dataset]
    return {"loss": float(tf.reduce_mean(tf.concat(errors, 0)))}


def _data():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(32, 3)).astype(np.float32)
  return tf.data.Dataset.from_tensor_slices((x, x @ np.float32([1, -2, .5])))


def _tags(logdir):
  events = event_accumulator.EventAccumulator(logdir)
  events.Reload()
  return set(events.Tags()["scalars"]) | set(events.Tags()["tensors"])


def test_a_minimal_trainer_runs_with_checkpoints_eval_and_tensorboard(
    tmp_path):
  inputs = keras.Input((3,))
  model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
  optimizer = keras.optimizers.SGD(0.05)
  step = tf.Variable(0, dtype=tf.int64, trainable=False)
  strategy = tf.distribute.get_strategy()
  parts = LoopParts(
      global_step=step, strategy=strategy, optimizer=optimizer,
      checkpoint={"model": model, "optimizer": optimizer, "global_step": step})
  model_dir = str(tmp_path / "run")
  touched = set()
  controller = framework.Controller(
      recording(TinyTrainer(model, optimizer, step), touched),
      framework.LoopConfig(train_steps=6, steps_per_loop=2, eval_every=4,
                           checkpoint_every=2, summary_every=2,
                           best_metric="eval/loss"),
      model_dir, parts=parts,
      checkpoints=checkpoints.for_loop(parts, model_dir, max_to_keep=5),
      train_input=lambda start: _data().repeat().batch(
          8, drop_remainder=True).skip(start),
      eval_input=lambda: _data().batch(8))
  results = controller.run()

  assert touched == {"train", "sync_replica_state", "evaluate"}
  assert len(touched) <= 5
  assert int(step.numpy()) == 6 and np.isfinite(results["loss"])
  for name in ("ckpt-2.index", "ckpt-4.index", "ckpt-6.index",
               "best/best.json", "metrics.jsonl"):
    assert os.path.exists(os.path.join(model_dir, name)), name
  assert {"loss", "learning_rate", "steps_per_second"} <= _tags(
      os.path.join(model_dir, "train"))
  assert "loss" in _tags(os.path.join(model_dir, "eval"))
  # A fresh run on the same directory resumes at step 6 (nothing to train).
  step.assign(0)
  again = framework.Controller(
      TinyTrainer(model, optimizer, step), framework.LoopConfig(train_steps=6),
      model_dir, parts=parts, train_input=lambda start: None,
      eval_input=lambda: _data().batch(8))
  again.restore()
  assert again.step == 6


def test_a_framework_trainer_handed_its_parts_is_touched_by_three_names(
    tmp_path):
  inputs = keras.Input((3,))
  model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
  trainer = framework.Trainer(model, keras.optimizers.SGD(0.1),
                              tf.distribute.get_strategy(),
                              global_batch_size=8)
  parts = loop_parts(trainer)
  assert parts.global_step is trainer.global_step
  assert parts.nan_policy == trainer.nan_policy
  assert set(parts.checkpoint) >= {"model", "optimizer", "global_step"}
  touched = set()
  labels = lambda: _data().map(lambda x, y: (x, tf.cast(y > 0, tf.int64)))
  framework.Controller(
      recording(trainer, touched),
      framework.LoopConfig(train_steps=4, steps_per_loop=2, eval_every=2,
                           checkpoint_every=2, best_metric="eval/accuracy"),
      str(tmp_path), parts=parts,
      train_input=lambda start: labels().repeat().batch(
          8, drop_remainder=True).skip(start),
      eval_input=lambda: labels().batch(8)).run()
  assert touched == {"train", "sync_replica_state", "evaluate"}
