"""Data parallelism is numerically single-device training on the global batch."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import framework
import framework.core.optimizers  # noqa: F401  (the attribute chain below)
import framework.data.datasets  # noqa: F401  (the attribute chain below)
import framework.data.inputs  # noqa: F401  (the attribute chain below)
import models

GLOBAL_BATCH = 32


@pytest.fixture(scope="module")
def data():
  # Prototype-plus-noise images: large, non-degenerate gradients, so Adam's
  # first steps do not turn round-off in near-zero gradients into sign flips.
  return framework.data.datasets.synthetic(num_train=256, num_test=37, image_shape=(4, 4, 3),
                             seed=1)


def make_trainer(strategy_name, *, optimizer="momentum", learning_rate=0.05,
                 trainer_cls=framework.Trainer, model="mlp", input_shape=(4, 4,
                                                                        3),
                 **trainer_kwargs):
  strategy = framework.make_strategy(strategy_name)
  keras.utils.set_random_seed(7)
  with strategy.scope():
    net = models.build_model(model, input_shape, 10, hidden_units=(16,),
                             dropout=False,
                             sync_batch_norm=trainer_kwargs.pop("sync", False))
    opt = framework.core.optimizers.make_optimizer(
        framework.OptimizerConfig(name=optimizer, learning_rate=learning_rate))
  return trainer_cls(net, opt, strategy, global_batch_size=GLOBAL_BATCH,
                     **trainer_kwargs)


def train(trainer, data, steps=5, input_mode="global"):
  iterator = iter(framework.data.inputs.distribute_train(
      trainer.strategy, data, GLOBAL_BATCH, seed=3, input_mode=input_mode))
  metrics = trainer.train(iterator, steps)
  return [v.numpy() for v in trainer.model.trainable_variables], {
      k: float(v) for k, v in metrics.items()}


def max_diff(a, b):
  return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def one_device(data):
  """(optimizer, learning_rate) -> (weights, metrics) of 5 one-device
  steps, each trained once: both strategies compare against it."""
  runs = {}

  def run(optimizer, learning_rate):
    if (optimizer, learning_rate) not in runs:
      runs[optimizer, learning_rate] = train(
          make_trainer("one_device", optimizer=optimizer,
                       learning_rate=learning_rate), data)
    return runs[optimizer, learning_rate]

  return run


@pytest.mark.parametrize("optimizer,learning_rate", [("momentum", 0.05),
                                                     ("adam", 1e-3)])
@pytest.mark.parametrize("strategy", ["mirrored", "central_storage"])
def test_distributed_equals_one_device(data, one_device, strategy, optimizer,
                                       learning_rate):
  single, single_metrics = one_device(optimizer, learning_rate)
  trainer = make_trainer(strategy, optimizer=optimizer,
                         learning_rate=learning_rate)
  assert trainer.num_replicas == 2
  weights, metrics = train(trainer, data)
  assert max_diff(single, weights) < 1e-5
  for name in ("loss", "accuracy", "grad_norm"):
    assert metrics[name] == pytest.approx(single_metrics[name], abs=1e-5)
  assert int(trainer.optimizer.iterations.numpy()) == 5
  assert int(trainer.global_step.numpy()) == 5


@pytest.mark.parametrize("strategy", ["mirrored", "central_storage"])
def test_reduced_gradient_equals_single_device_gradient(data, strategy):
  # With plain SGD one step moves each weight by -lr * gradient.
  def gradient(name):
    trainer = make_trainer(name, optimizer="sgd", learning_rate=1.0)
    before = [v.numpy() for v in trainer.model.trainable_variables]
    after, _ = train(trainer, data, steps=1)
    return [b - a for a, b in zip(after, before)]

  single = gradient("one_device")
  assert max(float(np.abs(g).max()) for g in single) > 1e-2
  assert max_diff(single, gradient(strategy)) < 1e-6


def test_per_replica_input_mode_matches_global(data):
  global_mode, _ = train(make_trainer("mirrored"), data)
  per_replica, _ = train(make_trainer("mirrored"), data,
                         input_mode="per_replica")
  assert max_diff(global_mode, per_replica) < 1e-6


class DoubleReduceTrainer(framework.Trainer):
  """The classic bug: reduce, then let something reduce again."""

  def train_step(self, batch):
    features, labels = batch
    with tf.GradientTape() as tape:
      loss = self.average(self.loss_fn(labels, self.model(features)))
    grads = self.all_reduce(self.all_reduce(
        tape.gradient(loss, self.model.trainable_variables)))
    self.apply_gradients(grads)
    return {"loss": loss}


def test_double_reduction_is_caught(data):
  single, _ = train(make_trainer("one_device", optimizer="sgd"), data,
                    steps=1)
  doubled, _ = train(make_trainer("mirrored", optimizer="sgd",
                                  trainer_cls=DoubleReduceTrainer), data,
                     steps=1)
  correct, _ = train(make_trainer("mirrored", optimizer="sgd"), data, steps=1)
  assert max_diff(single, correct) < 1e-6
  assert max_diff(single, doubled) > 1e-3


class PerReplicaClipTrainer(framework.Trainer):
  """Wrong: clips each replica's share before the reduction."""

  def train_step(self, batch):
    features, labels = batch
    with tf.GradientTape() as tape:
      loss = self.average(self.loss_fn(labels, self.model(features)))
    grads = tape.gradient(loss, self.model.trainable_variables)
    grads, _ = tf.clip_by_global_norm(grads, self.clip_norm)
    self.apply_gradients(self.all_reduce(grads))
    return {"loss": loss}


def test_clipping_acts_on_the_reduced_gradient(data):
  clip = 0.05  # well below the gradient norm (about 1), so clipping acts
  single, metrics = train(make_trainer("one_device", optimizer="sgd",
                                       clip_norm=clip), data, steps=3)
  assert metrics["grad_norm"] > 4 * clip
  mirrored, _ = train(make_trainer("mirrored", optimizer="sgd",
                                   clip_norm=clip), data, steps=3)
  per_replica, _ = train(make_trainer("mirrored", optimizer="sgd",
                                      clip_norm=clip,
                                      trainer_cls=PerReplicaClipTrainer),
                         data, steps=3)
  assert max_diff(single, mirrored) < 1e-6
  assert max_diff(single, per_replica) > 1e-4


def test_sync_batch_norm_matches_single_device():
  images = framework.data.datasets.synthetic(num_train=128, num_test=8, image_shape=(8, 8, 3))

  def run(name, sync):
    trainer = make_trainer(name, model="cifar_cnn", optimizer="sgd",
                           learning_rate=0.01, sync=sync,
                           input_shape=(8, 8, 3))
    weights, _ = train(trainer, images, steps=3)
    return weights + [v.numpy() for v in trainer.model.non_trainable_variables]

  single = run("one_device", False)
  assert max_diff(single, run("mirrored", True)) < 1e-5
  # Without synchronisation each replica normalises by its own half batch.
  assert max_diff(single, run("mirrored", False)) > 1e-4


@pytest.mark.parametrize("strategy", ["one_device", "mirrored",
                                      "central_storage"])
def test_evaluation_counts_every_example(data, strategy):
  trainer = make_trainer(strategy)
  # 37 examples in batches of 8: the last batch has 5, split over replicas.
  results = trainer.evaluate(framework.data.inputs.distribute_eval(
      trainer.strategy, data.test_x, data.test_y, 8))
  assert results["examples"] == 37
  logits = trainer.model(framework.data.inputs.to_float(data.test_x)).numpy()
  assert results["accuracy"] == pytest.approx(
      float(np.mean(logits.argmax(-1) == data.test_y)), abs=1e-6)
  loss = keras.losses.sparse_categorical_crossentropy(
      data.test_y, logits, from_logits=True).numpy().mean()
  assert results["loss"] == pytest.approx(float(loss), rel=1e-5)


def nan_batches(data, poison_step):
  x = framework.data.inputs.to_float(data.train_x[:GLOBAL_BATCH]).numpy()
  y = data.train_y[:GLOBAL_BATCH]
  bad = x.copy()
  bad[0] = 3e38  # overflows to Inf in the first layer, NaN after
  batches = [(bad if i == poison_step else x, y) for i in range(3)]
  return tf.data.Dataset.from_tensor_slices(
      (np.stack([b[0] for b in batches]), np.stack([b[1] for b in batches])))


def test_nan_policy_skip_leaves_the_state_unchanged(data):
  trainer = make_trainer("mirrored", optimizer="adam", nan_policy="skip")
  iterator = iter(trainer.strategy.experimental_distribute_dataset(
      nan_batches(data, poison_step=1)))
  trainer.train(iterator, 1)
  before = [v.numpy() for v in trainer.model.trainable_variables +
            trainer.optimizer.variables]
  metrics = trainer.train(iterator, 1)
  assert not np.isfinite(float(metrics["loss"]))
  after = [v.numpy() for v in trainer.model.trainable_variables +
           trainer.optimizer.variables]
  assert max_diff(before, after) == 0
  assert int(trainer.optimizer.iterations.numpy()) == 1
  trainer.train(iterator, 1)
  assert int(trainer.optimizer.iterations.numpy()) == 2


def test_trainer_rejects_bad_arguments():
  with pytest.raises(framework.ConfigError, match="global_batch_size=33"):
    make_trainer("mirrored").__class__(
        *(lambda t: (t.model, t.optimizer, t.strategy))(
            make_trainer("mirrored")), global_batch_size=33)
  with pytest.raises(framework.ConfigError, match="nan_policy='ignore'"):
    make_trainer("one_device", nan_policy="ignore")
  with pytest.raises(framework.ConfigError, match="clip_norm=0"):
    make_trainer("one_device", clip_norm=0)


def test_batch_norm_statistics_are_averaged_over_replicas():
  images = framework.data.datasets.synthetic(num_train=128, num_test=8, image_shape=(8, 8, 3))
  trainer = make_trainer("mirrored", model="cifar_cnn", optimizer="sgd",
                         learning_rate=0.01, input_shape=(8, 8, 3))
  train(trainer, images, steps=3)
  moving = [v.value for v in trainer.model.non_trainable_variables
            if "moving" in v.path]
  copies = [[c.numpy() for c in trainer.strategy.experimental_local_results(v)]
            for v in moving]
  assert max(np.abs(a - b).max() for a, b in copies) > 1e-6  # per replica
  trainer.sync_replica_state()
  for var, (a, b) in zip(moving, copies):
    for copy in trainer.strategy.experimental_local_results(var):
      np.testing.assert_allclose(copy.numpy(), (a + b) / 2, rtol=1e-6)
