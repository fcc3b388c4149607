"""Time to target from the loop's parts: `StopWhen` returns its decision
(it writes nothing), the tracker applies it once, and the metric a target
is measured on comes from the evaluator (`metric_aliases`), not the loop."""

import json
import os

import keras
import numpy as np
import tensorflow as tf

import framework
from framework.core import actions
from framework.core.checkpoints import run_files
from framework.core.config import StopCondition

BATCH = 8


def train_input(start_step):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(40, 3)).astype(np.float32)
  y = x.sum(axis=1)
  return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(
      BATCH, drop_remainder=True).skip(start_step)


def eval_input():
  return tf.data.Dataset.from_tensor_slices(
      (np.zeros((8, 3), np.float32), np.zeros(8, np.float32))).batch(BATCH)


class AliasedTrainer:
  """A protocol-only trainer whose evaluator reports its accuracy as
  `pixel_accuracy` and says so (`metric_aliases`), as segmentation does."""

  metric_aliases = {"accuracy": "pixel_accuracy"}

  def __init__(self):
    self.strategy = tf.distribute.get_strategy()
    keras.utils.set_random_seed(0)
    inputs = keras.Input((3,))
    self.model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    self.optimizer = keras.optimizers.SGD(0.01)
    self.optimizer.build(self.model.trainable_variables)
    self.global_step = tf.Variable(0, dtype=tf.int64)

  def train(self, iterator, num_steps):
    for _ in range(num_steps):
      next(iterator)
      self.global_step.assign_add(1)
    return {"loss": 1.0}

  def sync_replica_state(self):
    pass

  def evaluate(self, dataset):
    del dataset
    step = int(self.global_step.numpy())
    return {"pixel_accuracy": 0.25 * step, "loss": 1.0}


def test_stop_when_returns_a_decision_and_changes_nothing():
  stop = actions.StopWhen(StopCondition.parse("eval/accuracy>=0.5"),
                          aliases={"accuracy": "pixel_accuracy"})
  assert stop(3, {"pixel_accuracy": 0.25}) is None
  decision = stop(4, {"pixel_accuracy": 0.75})
  assert isinstance(decision, actions.TargetReached)
  assert isinstance(decision, actions.Stop)
  assert (decision.metric, decision.value) == ("accuracy", 0.75)
  assert decision.reason == "stop_when eval/accuracy>=0.5"
  assert set(vars(stop)) == {"condition", "description", "results",
                             "aliases"}


def test_the_target_is_read_under_the_evaluators_alias(tmp_path):
  loop = framework.LoopConfig(train_steps=10, steps_per_loop=1,
                              checkpoint_every=0, eval_every=1,
                              stop_at_accuracy=0.5, summary_every=1,
                              log_every=1)
  controller = framework.Controller(AliasedTrainer(), loop, str(tmp_path),
                                    train_input=train_input,
                                    eval_input=eval_input)
  controller.run()
  # 0.25 * step reaches 0.5 at step 2: the run stops there.
  assert controller.step == 2
  assert controller.time_to_target is not None
  record = json.loads((tmp_path / run_files.TARGET_FILE).read_text())
  assert record["step"] == 2 and record["accuracy"] == 0.5
  assert record["metrics"]["pixel_accuracy"] == 0.5

  # Relaunched with the same settings: finished, nothing trains.
  again = framework.Controller(AliasedTrainer(), loop, str(tmp_path),
                               train_input=train_input,
                               eval_input=eval_input)
  results = again.run()
  assert again.step == 2 and results["pixel_accuracy"] == 0.5
  assert again.time_to_target is None and again.measure_target


def test_an_action_that_returns_stop_ends_the_run(tmp_path):
  loop = framework.LoopConfig(train_steps=10, steps_per_loop=1,
                              checkpoint_every=0, summary_every=0,
                              log_every=0)
  controller = framework.Controller(
      AliasedTrainer(), loop, str(tmp_path), train_input=train_input,
      train_actions=[lambda step, outputs: (
          actions.Stop("enough") if step == 3 else None)])
  controller.run()
  assert controller.step == 3 and controller.stop_reason == "enough"
  assert os.path.exists(os.path.join(str(tmp_path), "ckpt-3.index"))
