"""The trainer contract: the loop, the run and the parameter-server wrapper
read a trainer only through the protocols of `framework.core.protocols`,
and a trainer with only the required ones runs `framework.run` end to end.
"""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import framework
from framework.app import experiment, export, factory
from framework.core import protocols, ps_training
from framework.core.trainer import Trainer
from shared_strategy import mirrored

pytestmark = pytest.mark.slow


def recording(target, reads):
  """`target` behind a proxy that adds to `reads` the name of every
  attribute anyone reads (or sets) on it.

  Each of the target's names is a property of the proxy's own class, so
  protocol checks see them under any Python (3.12 checks protocols with
  `inspect.getattr_static`); a name the target lacks goes through
  `__getattr__` and is recorded too.
  """

  def forward(name):

    def get(self):
      reads.add(name)
      return getattr(target, name)

    def put(self, value):
      reads.add(name)
      setattr(target, name, value)

    return property(get, put)

  def missing(self, name):
    if not name.startswith("__"):
      reads.add(name)
    raise AttributeError(name)

  names = {n for n in dir(target) if not n.startswith("__")}
  cls = type(f"Recording{type(target).__name__}", (),
             {**{n: forward(n) for n in names}, "__getattr__": missing})
  return cls()


def _config(model_dir, **kwargs):
  loop = framework.LoopConfig(train_steps=4, steps_per_loop=2, eval_every=2,
                              checkpoint_every=2, summary_every=2,
                              log_every=2, best_metric="eval/accuracy")
  return framework.ExperimentConfig(**dict(dict(
      model="mlp", dataset="synthetic", model_dir=str(model_dir),
      global_batch_size=16, train_steps=4,
      model_options={"hidden_units": (16,)}, loop=loop), **kwargs))


def test_every_attribute_read_of_a_trainer_is_declared(tmp_path):
  reads = set()

  def make_trainer(model, optimizer, strategy, **options):
    return recording(Trainer(model, optimizer, strategy, **options), reads)

  model_dir = tmp_path / "run"
  # Train, evaluate, checkpoint, best/, the EMA's swap, the export.
  results = experiment.run(
      _config(model_dir, strategy="mirrored", ema_decay=0.5,
              export_saved_model=True),
      strategy=mirrored(), make_trainer=make_trainer)
  assert np.isfinite(results["loss"])
  for name in ("ckpt-4.index", export.WEIGHTS_FILE,
               export.RAW_WEIGHTS_FILE, "export", "best"):
    assert os.path.exists(model_dir / name), name
  # The Controller on its own too: a fresh one evaluates the checkpoint.
  run_reads = set(reads)
  model, optimizer, _ = factory.build_model_and_optimizer(
      _config(model_dir), mirrored(),
      framework.data.datasets.synthetic(num_train=64, num_test=8))
  trainer = recording(Trainer(model, optimizer, mirrored(),
                              global_batch_size=16), reads)
  controller = framework.Controller(
      trainer, framework.LoopConfig(train_steps=4), str(model_dir),
      train_input=lambda step: None,
      eval_input=lambda: tf.data.Dataset.from_tensor_slices(
          (np.zeros((5, 32, 32, 3), np.float32),
           np.zeros(5, np.int64))).batch(4))
  assert set(controller.evaluate()) >= {"loss", "accuracy"}

  undeclared = reads - protocols.declared_names()
  assert not undeclared, f"read but declared by no protocol: {undeclared}"
  # The recorder saw what the run needs (it records, it is not empty).
  assert run_reads >= {"model", "optimizer", "strategy", "global_step",
                       "train", "evaluate", "sync_replica_state",
                       "export_model", "ema", "averaged_weights",
                       "loss_scale", "global_batch_size", "run_eval_step"}


class MinimalTrainer:
  """`LoopTrainer` and `LoopEvaluator` only: its own tf.function step on
  one device, and an evaluation over the run's padded batches."""

  def __init__(self, model, optimizer, strategy):
    self.model, self.optimizer, self.strategy = model, optimizer, strategy
    with strategy.scope():
      self.global_step = tf.Variable(0, dtype=tf.int64, trainable=False)
    self._loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

  @tf.function
  def _step(self, x, y):
    with tf.GradientTape() as tape:
      loss = self._loss(y, self.model(x, training=True))
    grads = tape.gradient(loss, self.model.trainable_variables)
    self.optimizer.apply_gradients(zip(grads, self.model.trainable_variables))
    self.global_step.assign_add(1)
    return loss

  def train(self, iterator, num_steps):
    losses = [self._step(*next(iterator)) for _ in range(num_steps)]
    return {"loss": float(tf.reduce_mean(losses))}

  def sync_replica_state(self):
    pass

  def evaluate(self, dataset):
    right = total = 0.0
    for element in dataset:
      (x, y), mask = element.batch, element.mask
      hit = tf.cast(tf.equal(tf.argmax(self.model(x), -1),
                             tf.cast(y, tf.int64)), tf.float32)
      right += float(tf.reduce_sum(hit * mask))
      total += float(tf.reduce_sum(mask))
    return {"accuracy": right / total, "examples": total}


def test_a_trainer_with_only_the_required_protocols_runs_end_to_end(
    tmp_path, caplog):
  made = []

  def make_trainer(model, optimizer, strategy, **options):
    del options  # its own step: no clipping, NaN policy, ...
    made.append(MinimalTrainer(model, optimizer, strategy))
    return made[0]

  model_dir = tmp_path / "run"
  caplog.set_level("INFO")
  results = experiment.run(_config(model_dir, export_saved_model=True),
                           make_trainer=make_trainer)
  trainer = made[0]
  assert isinstance(trainer, protocols.LoopTrainer)
  assert isinstance(trainer, protocols.LoopEvaluator)
  assert [name for name in protocols.OPTIONAL if hasattr(trainer, name)] == []
  assert int(trainer.global_step.numpy()) == 4
  assert results["examples"] == 512.0 and 0.0 <= results["accuracy"] <= 1.0
  for name in ("ckpt-2.index", "ckpt-4.index", export.WEIGHTS_FILE,
               "export/saved_model.pb", "best/best.json"):
    assert os.path.exists(model_dir / name), name
  assert not os.path.exists(model_dir / export.RAW_WEIGHTS_FILE)
  said = [r.getMessage() for r in caplog.records
          if "has no export_model()" in r.getMessage()]
  assert len(said) == 1 and "MinimalTrainer" in said[0]
  # The weights file holds the trained weights.
  rebuilt = keras.models.clone_model(trainer.model)
  rebuilt.load_weights(str(model_dir / export.WEIGHTS_FILE))
  for a, b in zip(rebuilt.get_weights(), trainer.model.get_weights()):
    np.testing.assert_array_equal(a, b)


def test_the_parameter_server_wrapper_forwards_a_declared_list():
  with mirrored().scope():
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
    optimizer = keras.optimizers.SGD(0.1)
  trainer = Trainer(model, optimizer, mirrored(), global_batch_size=4)
  assert set(ps_training.CoordinatedTrainer.FORWARDED) <= (
      protocols.declared_names())
  # Without a cluster: the forwarding alone (the coordinator needs one).
  coordinated = object.__new__(ps_training.CoordinatedTrainer)
  coordinated._forward(trainer)  # pylint: disable=protected-access
  assert coordinated.model is model and coordinated.global_step is (
      trainer.global_step)
  own = ("distribute_dataset",)
  step_only = ("distributed_train_step", "run_step", "step_variables",
               "clip_norm", "grad_accum_steps")
  for name in protocols.OPTIONAL:
    if name not in own + step_only:
      assert hasattr(coordinated, name) == hasattr(trainer, name), name
  for protocol in (protocols.LoopTrainer, protocols.LoopEvaluator):
    assert isinstance(coordinated, protocol), protocol.__name__
  assert not isinstance(coordinated, protocols.Steppable)
  # What it does not declare, it does not have.
  for name in ("clip_norm", "train_step", "eval_sums", "no_such_name"):
    assert not hasattr(coordinated, name), name
  assert not hasattr(coordinated, "metric_aliases")
