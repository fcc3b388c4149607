"""The Controller's declared contract: a protocol-only trainer, any metric
names, actions (stop requests, stop_when), summaries from inside the step."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorboard.backend.event_processing import event_accumulator

import framework
from framework.app import experiment
from framework.core import protocols
from framework.core.actions import StopCondition
from shared_strategy import mirrored

BATCH = 8


def _data():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(40, 3)).astype(np.float32)
  y = (x @ np.array([1.0, -2.0, 0.5], np.float32)).astype(np.float32)
  return tf.data.Dataset.from_tensor_slices((x, y))


def train_input(start_step):
  return _data().repeat().batch(BATCH, drop_remainder=True).skip(start_step)


def eval_input():
  return _data().batch(BATCH)


def scalars(logdir, tag):
  acc = event_accumulator.EventAccumulator(
      logdir, size_guidance={event_accumulator.TENSORS: 0})
  acc.Reload()
  return {e.step: float(tf.make_ndarray(e.tensor_proto))
          for e in acc.Tensors(tag)}


def _model():
  keras.utils.set_random_seed(0)
  inputs = keras.Input((3,))
  return keras.Model(inputs, keras.layers.Dense(1)(inputs))


class MinimalTrainer:
  """Only `protocols.LoopTrainer` and `LoopEvaluator`, on one device;
  returns `xent`, not `loss`."""

  def __init__(self):
    self.strategy = tf.distribute.get_strategy()
    self.model = _model()
    self.optimizer = keras.optimizers.SGD(0.05)
    self.optimizer.build(self.model.trainable_variables)
    self.global_step = tf.Variable(0, dtype=tf.int64)

  @tf.function
  def _step(self, x, y):
    with tf.GradientTape() as tape:
      xent = tf.reduce_mean(tf.square(self.model(x)[:, 0] - y))
    grads = tape.gradient(xent, self.model.trainable_variables)
    self.optimizer.apply_gradients(zip(grads, self.model.trainable_variables))
    self.global_step.assign_add(1)
    return xent

  def train(self, iterator, num_steps):
    values = [self._step(*next(iterator)) for _ in range(num_steps)]
    return {"xent": tf.reduce_mean(values)}

  def sync_replica_state(self):
    pass

  def evaluate(self, dataset):
    errors = [tf.square(self.model(x)[:, 0] - y) for x, y in dataset]
    return {"xent": float(tf.reduce_mean(tf.concat(errors, 0)))}


def _loop(train_steps, **kwargs):
  return framework.LoopConfig(train_steps=train_steps, steps_per_loop=2,
                              checkpoint_every=2, summary_every=2,
                              log_every=2, **kwargs)


def test_protocol_only_trainer_trains_checkpoints_resumes_evaluates(tmp_path):
  trainer = MinimalTrainer()
  assert isinstance(trainer, protocols.LoopTrainer)
  assert not hasattr(trainer, "global_batch_size")
  controller = framework.Controller(trainer, _loop(4), str(tmp_path),
                                    train_input=train_input,
                                    eval_input=eval_input)
  first = controller.run()
  assert controller.step == 4 and set(first) == {"xent"}
  xent = scalars(str(tmp_path / "train"), "xent")
  assert sorted(xent) == [2, 4] and all(np.isfinite(list(xent.values())))
  weights = trainer.model.get_weights()

  resumed = MinimalTrainer()  # fresh weights: the checkpoint brings them
  controller = framework.Controller(resumed, _loop(6), str(tmp_path),
                                    train_input=train_input,
                                    eval_input=eval_input)
  controller.restore()
  assert controller.step == 4
  np.testing.assert_array_equal(resumed.model.get_weights()[0], weights[0])
  last = controller.run()
  assert controller.step == 6 and last["xent"] < first["xent"]
  assert sorted(scalars(str(tmp_path / "eval"), "xent")) == [4, 6]


def test_not_a_trainer_is_a_config_error(tmp_path):
  with pytest.raises(framework.ConfigError, match="lacks .*sync_replica_state"):
    framework.Controller(object(), _loop(2), str(tmp_path),
                         train_input=train_input)


class XentTrainer(framework.Trainer):
  """A step that returns only `xent` and writes summaries from inside."""

  def train_step(self, batch):
    x, y = batch
    with tf.GradientTape() as tape:
      xent = self.average(tf.square(self.model(x, training=True)[:, 0] - y))
    grads = self.all_reduce(tape.gradient(xent,
                                          self.model.trainable_variables))
    self.apply_gradients(grads)
    # Recorded at this step's number, on summary_every steps, once.
    tf.summary.scalar("inside/step", tf.cast(self.global_step + 1,
                                             tf.float32))
    return {"xent": xent}

  def eval_step(self, batch):
    x, y = batch
    tf.summary.scalar("inside/eval", 1.0)
    return {"xent": tf.reduce_sum(tf.square(self.model(x)[:, 0] - y)),
            "examples": tf.cast(tf.shape(y)[0], tf.float32)}


def _xent_controller(model_dir, train_steps, **kwargs):
  strategy = mirrored()
  with strategy.scope():
    model = _model()
    optimizer = keras.optimizers.SGD(0.05)
  trainer = XentTrainer(model, optimizer, strategy, global_batch_size=BATCH)
  loop = framework.LoopConfig(train_steps=train_steps, steps_per_loop=3,
                              checkpoint_every=0, summary_every=2,
                              log_every=2)
  kwargs.setdefault("eval_input", eval_input)
  return framework.Controller(trainer, loop, str(model_dir),
                              train_input=train_input, **kwargs)


def test_xent_step_and_summaries_from_inside_the_step(tmp_path):
  controller = _xent_controller(tmp_path, 7)
  results = controller.run()
  assert set(results) == {"xent", "examples"}
  assert sorted(scalars(str(tmp_path / "train"), "xent")) == [2, 4, 6, 7]
  # Each step ran inside a 3-step graph loop (events at 2, 4, 6 split the
  # loops 2+2+2+1); the in-step summary is written at steps 2, 4 and 6 only.
  assert scalars(str(tmp_path / "train"), "inside/step") == {
      2: 2.0, 4: 4.0, 6: 6.0}
  assert sorted(scalars(str(tmp_path / "eval"), "inside/eval")) == [7]
  assert os.path.exists(str(tmp_path / "checkpoint"))


def test_nan_policy_watches_every_value_without_a_loss(tmp_path):
  class Diverging(MinimalTrainer):
    def train(self, iterator, num_steps):
      super().train(iterator, num_steps)
      return {"xent": float("nan"), "other": 1.0}

  controller = framework.Controller(Diverging(), _loop(4), str(tmp_path),
                                    train_input=train_input)
  with pytest.raises(framework.NonFiniteLossError,
                     match=r"xent is nan in steps 1\.\.2"):
    controller.run()
  assert not os.path.exists(str(tmp_path / "checkpoint"))


def test_trainer_request_stop_from_an_action_ends_the_run_once(tmp_path):
  controller = _xent_controller(tmp_path, 12, eval_input=None)
  controller.train_actions.append(
      lambda step, outputs: step == 4 and controller.trainer.request_stop())
  controller.run()
  assert controller.step == 4  # not 12: the request ended the run
  assert controller.checkpoints.latest.endswith("ckpt-4")
  # The request was cleared: the trainer's next call runs all its steps.
  iterator = iter(mirrored().experimental_distribute_dataset(train_input(4)))
  controller.trainer.train(iterator, 3)
  assert controller.step == 7


def test_stop_when_parses_and_rejects():
  condition = StopCondition.parse("eval/iou/class_0 >= 0.5")
  assert (condition.split, condition.metric, condition.op,
          condition.value) == ("eval", "iou/class_0", ">=", 0.5)
  assert condition.met({"iou/class_0": 0.5})
  assert not StopCondition.parse("train/loss<0.1").met({"loss": 0.1})
  for bad in ("loss<0.1", "eval/loss=0.1", "eval/loss<", "eval/loss<nan"):
    with pytest.raises(framework.ConfigError, match="stop_when="):
      framework.LoopConfig(train_steps=1, stop_when=bad)
  with pytest.raises(framework.ConfigError, match="set one"):
    framework.LoopConfig(train_steps=1, stop_when="eval/loss<1",
                         stop_at_accuracy=0.5)
  with pytest.raises(framework.ConfigError, match="no 'accuracy'"):
    StopCondition.parse("eval/accuracy>0.5").met({"loss": 1.0})


def _artifacts(model_dir):
  names = []
  for folder, _, files in os.walk(model_dir):
    for name in files:
      rel = os.path.relpath(os.path.join(folder, name), model_dir)
      names.append("EVENTS" if "tfevents" in name else rel)
  return sorted(set(names) - {"run.lock"})


@pytest.mark.slow  # two runs with their exports
def test_eval_action_stop_has_the_artifacts_of_a_normal_end(tmp_path):
  def run(model_dir, train_steps, **loop):
    config = framework.ExperimentConfig(
        model="mlp", dataset="synthetic", model_dir=str(model_dir),
        strategy="mirrored", global_batch_size=16, train_steps=train_steps,
        loop=framework.LoopConfig(train_steps=train_steps, steps_per_loop=2,
                                  eval_every=2, checkpoint_every=0, **loop))
    return experiment.run(config, strategy=mirrored())

  stopped = run(tmp_path / "stopped", 20, stop_when="eval/loss<1e9")
  normal = run(tmp_path / "normal", 2)
  assert scalars(str(tmp_path / "stopped" / "eval"), "loss").keys() == {2}
  assert stopped == normal
  assert _artifacts(tmp_path / "stopped") == _artifacts(tmp_path / "normal")
  assert "model.weights.h5" in _artifacts(tmp_path / "normal")
  assert any(a.startswith("export") for a in _artifacts(tmp_path / "normal"))
  assert any(a.startswith("ckpt-2") for a in _artifacts(tmp_path / "normal"))
  assert sorted(scalars(str(tmp_path / "stopped" / "eval"),
                        "time_to_target_seconds")) == [2]


_PLAIN_SCRIPT = """
import sys
sys.path.insert(0, {root!r})
import keras, tensorflow as tf
import framework
model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
strategy = tf.distribute.get_strategy()
trainer = framework.Trainer(model, keras.optimizers.SGD(0.1), strategy,
                            global_batch_size=4)
data = tf.data.Dataset.from_tensor_slices(
    (tf.zeros([8, 3]), tf.zeros([8], tf.int32)))
framework.Controller(
    trainer, framework.LoopConfig(train_steps=2, log_every=1),
    {model_dir!r}, train_input=lambda s: data.repeat().batch(4)).run()
"""


def test_progress_shows_from_a_plain_python_process(tmp_path):
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  proc = subprocess.run(
      [sys.executable, "-c", _PLAIN_SCRIPT.format(root=root,
                                                  model_dir=str(tmp_path))],
      capture_output=True, text=True, timeout=300,
      env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "train step 2/2: loss=" in proc.stderr

