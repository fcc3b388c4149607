"""A recomputed segment replays its layers' state: the same dropout masks,
BatchNorm statistics updated once (`framework.model_parallel.recompute`)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from framework.model_parallel import recompute
import shared_strategy


class DropoutBlock(keras.layers.Layer):
  """Dense -> BatchNorm -> Dropout with a residual add; declares itself a
  block (as the GPT's Block does)."""

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.recompute_segment = recompute.wants("block")
    self.dense = keras.layers.Dense(12, activation="relu")
    self.norm = keras.layers.BatchNormalization()
    self.drop = keras.layers.Dropout(0.4)

  def call(self, x, training=None):
    return recompute.segment(
        self, "block",
        lambda x: x + self.drop(self.norm(self.dense(x), training=training),
                                training=training), x)


def _model(value, sequential=False):
  """Dropout, BatchNorm and residual adds, top level and inside blocks (or
  a Sequential chain of Dense, BatchNorm and Dropout)."""
  keras.utils.set_random_seed(2468)
  with recompute.policy(value) as declared:
    if sequential:
      model = keras.Sequential([
          keras.Input((9,)), keras.layers.Dense(12, activation="relu"),
          keras.layers.BatchNormalization(), keras.layers.Dropout(0.3),
          keras.layers.Dense(12, activation="relu"),
          keras.layers.Dropout(0.2), keras.layers.Dense(3)])
      return recompute.apply(model, value, declared)
    x = keras.Input((9,))
    h = keras.layers.Dense(12, activation="relu")(x)
    h = keras.layers.BatchNormalization()(h)
    d = keras.layers.Dropout(0.3)(h)
    h = keras.layers.Add()([h, keras.layers.Dense(12)(d)])
    h = DropoutBlock()(h)
    h = keras.layers.Dropout(0.2)(h)
    h = DropoutBlock()(h)
    model = keras.Model(x, keras.layers.Dense(3)(h))
  return recompute.apply(model, value, declared)


def _train(value, strategy, steps=3, sequential=False):
  """Every variable (weights, BatchNorm statistics, dropout seed states)
  after `steps` SGD steps on the global batch under `strategy`."""
  with strategy.scope():
    model = _model(value, sequential)
    optimizer = keras.optimizers.SGD(0.05)
  x = np.random.RandomState(3).randn(16, 9).astype("float32")
  y = np.random.RandomState(4).randn(16, 3).astype("float32")
  dataset = strategy.experimental_distribute_dataset(
      tf.data.Dataset.from_tensors((x, y)).repeat())

  @tf.function
  def step(batch):
    def replica(features, targets):
      with tf.GradientTape() as tape:
        loss = tf.reduce_sum(
            (model(features, training=True) - targets) ** 2) / (16 * 3)
      grads = tape.gradient(loss, model.trainable_variables)
      grads = tf.distribute.get_replica_context().all_reduce("sum", grads)
      optimizer.apply(grads, model.trainable_variables)
    strategy.run(replica, args=batch)

  batches = iter(dataset)
  for _ in range(steps):
    step(next(batches))
  return {v.path: np.asarray(v.numpy()) for v in model.variables}


@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("value,sequential", [
    ("blocks", False), ("every:1", False), ("every:2", False),
    ("every:3", False), ("every:2", True)])
def test_dropout_and_batch_norm_recomputed_equal_not_recomputed(
    replicas, value, sequential):
  strategy = (shared_strategy.mirrored() if replicas == 2
              else tf.distribute.get_strategy())
  reference = _train(False, strategy, sequential=sequential)
  recomputed = _train(value, strategy, sequential=sequential)
  # The same variables: the seed states and statistics included.
  assert len(recomputed) == len(reference)
  for (name, want), got in zip(reference.items(), recomputed.values()):
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6, err_msg=name)
  keras.backend.clear_session()
