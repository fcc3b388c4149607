"""Gradient accumulation: K micro-batches give the update of the whole batch."""

import numpy as np
import pytest
import tensorflow as tf

import framework
import framework.core.optimizers  # noqa: F401  (the attribute chain below)
import framework.data.datasets  # noqa: F401  (the attribute chain below)
import framework.data.inputs  # noqa: F401  (the attribute chain below)
import models
from tests import shared_strategy


def _train(strategy, data, grad_accum_steps, steps=3, global_batch_size=32):
  keras_seed = 7
  tf.keras.utils.set_random_seed(keras_seed)
  with strategy.scope():
    model = models.build_model("mlp", data.input_shape, 10,
                               hidden_units=(16,))
    optimizer = framework.core.optimizers.make_optimizer(
        framework.OptimizerConfig(name="momentum", learning_rate=0.1))
  trainer = framework.Trainer(model, optimizer, strategy,
                              global_batch_size=global_batch_size,
                              grad_accum_steps=grad_accum_steps)
  iterator = iter(framework.data.inputs.distribute_train(strategy, data,
                                             global_batch_size))
  metrics = trainer.train(iterator, steps)
  return ([w.numpy() for w in model.trainable_variables],
          {k: float(v) for k, v in metrics.items()},
          int(optimizer.iterations.numpy()))


@pytest.fixture(scope="module")
def data():
  return framework.data.datasets.synthetic(num_train=128, num_test=8, image_shape=(4, 4, 3))


def test_accumulation_equals_the_whole_batch(data):
  # Inside strategy.run on 2 replicas: each sums 4 micro-batches of 4.
  strategy = shared_strategy.mirrored()
  whole, whole_metrics, whole_updates = _train(strategy, data, 1)
  accumulated, metrics, updates = _train(strategy, data, 4)
  assert updates == whole_updates == 3  # one update per step, not per micro
  for a, b in zip(accumulated, whole):
    np.testing.assert_allclose(a, b, atol=1e-5)
  for name in ("loss", "accuracy", "grad_norm"):
    assert metrics[name] == pytest.approx(whole_metrics[name], abs=1e-5)


def test_accumulation_must_divide_the_replica_batch(data):
  strategy = shared_strategy.mirrored()
  with pytest.raises(framework.ConfigError, match="grad_accum_steps=3"):
    _train(strategy, data, 3)
