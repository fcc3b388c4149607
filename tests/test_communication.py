"""The gradient all-reduce's knobs: packing, implementation, bfloat16 wire.

Packing is tested on the collective all-reduce that MultiWorkerMirrored-
Strategy runs, here between the 2 logical CPU devices of this process
(TensorFlow's CollectiveAllReduce under a MirroredStrategy), so that the
options reach the code that splits the gradients into packs.
"""

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.distribute import cross_device_ops  # pylint: disable=g-direct-tensorflow-import
from tensorflow.python.distribute import cross_device_utils  # pylint: disable=g-direct-tensorflow-import

import framework
import framework.core.optimizers  # noqa: F401  (the attribute chain below)
import models
from framework.core import gradients
from framework.core.gradients import AllReduceConfig
from framework.errors import ConfigError
from test_trainer import data, max_diff, train  # pylint: disable=unused-import

GLOBAL_BATCH = 32


@functools.lru_cache(maxsize=None)
def collective_strategy():
  devices = [d.name for d in tf.config.list_logical_devices("CPU")]
  assert len(devices) == 2
  # Its own group keys: no clash with the shared MirroredStrategy's.
  ops = cross_device_ops.CollectiveAllReduce(
      devices, len(devices), tf.distribute.experimental.CommunicationOptions(),
      collective_keys=cross_device_utils.CollectiveKeys(group_key_start=1000))
  return tf.distribute.MirroredStrategy(devices, cross_device_ops=ops)


def make_trainer(strategy, all_reduce=None):
  keras.utils.set_random_seed(7)
  with strategy.scope():
    net = models.build_model("mlp", (4, 4, 3), 10, hidden_units=(16, 16),
                             dropout=False)
    opt = framework.core.optimizers.make_optimizer(
        framework.OptimizerConfig(name="momentum", learning_rate=0.05))
  return framework.Trainer(net, opt, strategy, global_batch_size=GLOBAL_BATCH,
                           all_reduce=all_reduce)


def collective_reduces(trainer):
  """How many collective all-reduces one traced train step issues."""
  step = tf.function(lambda batch: trainer.strategy.run(trainer.train_step,
                                                        args=(batch,)))
  graph = step.get_concrete_function((tf.TensorSpec([16, 4, 4, 3]),
                                      tf.TensorSpec([16], tf.int32))).graph
  return sum(op.type.startswith("CollectiveReduce")
             for op in graph.get_operations()) // 2  # one per device


def test_packing_and_implementation_give_today_s_weights(data):
  default = make_trainer(collective_strategy())
  packed = make_trainer(collective_strategy(), AllReduceConfig(
      bytes_per_pack=1024, implementation="ring"))
  initial = [v.numpy() for v in packed.model.trainable_variables]
  # The MLP's 6 gradients (4x4x3x16 + 16 + 16x16 + 16 + 16x10 + 10 floats)
  # go out as one all-reduce, or in packs of about 1 KiB.
  assert collective_reduces(default) == 1
  assert collective_reduces(packed) > 1
  reference, _ = train(default, data)
  weights, _ = train(packed, data)
  assert max_diff(reference, weights) <= 1e-6
  assert max_diff(initial, weights) > 1e-3  # the weights moved


@pytest.mark.parametrize("strategy_fn", [
    collective_strategy, lambda: framework.make_strategy("mirrored")],
    ids=["collective", "mirrored"])
def test_overlap_gives_today_s_weights_bucket_by_bucket(data, strategy_fn):
  default = make_trainer(strategy_fn())
  overlapped = make_trainer(strategy_fn(), AllReduceConfig(
      overlap=True, bytes_per_pack=1024))
  initial = [v.numpy() for v in overlapped.model.trainable_variables]
  if strategy_fn is collective_strategy:
    # 6 gradients of 3072, 64, 1024, 64, 640, 40 bytes, last first: the
    # buckets [40, 640, 64, 1024] and [64, 3072].
    assert collective_reduces(overlapped) == 2
  reference, _ = train(default, data)
  weights, _ = train(overlapped, data)
  assert max_diff(reference, weights) <= 1e-6
  assert max_diff(initial, weights) > 1e-3  # the weights moved


def test_gradient_buckets_go_last_layer_first():
  grads = [tf.zeros([256]), tf.zeros([4]), tf.zeros([256]), tf.zeros([4])]
  assert gradients.gradient_buckets(grads, 1024) == [[3, 2], [1, 0]]
  assert gradients.gradient_buckets(grads, 1 << 20) == [[3, 2, 1, 0]]
  assert gradients.gradient_buckets(grads, 1) == [[3], [2], [1], [0]]
  assert gradients.gradient_buckets(grads, 2000) == [[3, 2, 1, 0]]


def test_bfloat16_reduction_is_float32_within_its_rounding(data):
  strategy = framework.make_strategy("mirrored")
  rng = np.random.default_rng(0)
  shares = [(rng.normal(size=(1000,)) * 10.0 ** rng.integers(
      -6, 3, size=(1000,))).astype(np.float32) for _ in range(2)]

  def reduced(config):
    trainer = make_trainer(strategy, config)
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.constant(shares[ctx.replica_id_in_sync_group]))
    result = tf.function(lambda v: strategy.run(
        lambda g: trainer.all_reduce([g])[0], args=(v,)))(values)
    return strategy.experimental_local_results(result)[0]

  exact = reduced(None)
  bf16 = reduced(AllReduceConfig(dtype="bfloat16"))
  assert bf16.dtype == tf.float32  # applied in float32
  np.testing.assert_allclose(exact.numpy(), shares[0] + shares[1], rtol=1e-6)
  error = np.abs(bf16.numpy() - exact.numpy())
  # Each share rounded to bfloat16 (8 significant bits, unit round-off
  # 2^-8), then the sum:
  # at most 2^-8 of each share's magnitude plus 2^-8 of the sum's.
  bound = 2.0 ** -8 * (np.abs(shares[0]) + np.abs(shares[1])
                       + np.abs(exact.numpy())) * 1.001
  assert np.all(error <= bound)
  assert error.max() > 0  # it did reduce in bfloat16
  # Training: 5 steps stay close to the float32 reduction's weights.
  weights32, _ = train(make_trainer(strategy), data)
  trainer = make_trainer(strategy, AllReduceConfig(dtype="bfloat16"))
  weights16, _ = train(trainer, data)
  assert all(v.dtype == tf.float32 for v in trainer.model.trainable_variables)
  assert 0 < max_diff(weights32, weights16) <= 2e-3


def test_overlap_with_bfloat16_gives_the_bfloat16_weights(data):
  # Buckets change which collective carries a gradient, not its rounding.
  bf16 = make_trainer(collective_strategy(), AllReduceConfig(dtype="bfloat16"))
  both = make_trainer(collective_strategy(), AllReduceConfig(
      dtype="bfloat16", overlap=True, bytes_per_pack=512))
  assert collective_reduces(both) == 2  # 20+320+32+512 and 32+1536 bytes
  weights16, _ = train(bf16, data)
  weights, _ = train(both, data)
  assert max_diff(weights16, weights) <= 1e-6
  weights32, _ = train(make_trainer(collective_strategy()), data)
  assert max_diff(weights32, weights) > 0  # it did reduce in bfloat16


@pytest.mark.parametrize("kwargs,message", [
    (dict(bytes_per_pack=-1), "all_reduce_bytes_per_pack=-1 must be"),
    (dict(implementation="mpi"), "all_reduce_implementation"),
    (dict(dtype="float16"), "all_reduce_dtype"),
])
def test_bad_all_reduce_config_names_the_argument(kwargs, message):
  with pytest.raises(ConfigError, match=message):
    AllReduceConfig(**kwargs)
