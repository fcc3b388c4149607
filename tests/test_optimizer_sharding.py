"""Optimizer-state sharding (ZeRO-1) on 2 mirrored replicas: the same
weights as the unsharded update (XLA-compiled too), 1/N of the slots per
device, and checkpoints that either layout restores."""

import tempfile

import keras
import numpy as np
import pytest
import tensorflow as tf

import framework
from framework.core import protocols
from framework.errors import ConfigError
from test_trainer import data, make_trainer, max_diff, train  # pylint: disable=unused-import

CASES = [("momentum", 0.05), ("adam", 1e-3), ("adamw", 1e-3)]
STEPS = 6


def full_slots(trainer):
  """The optimizer's slots as a checkpoint holds them: {key: array}."""
  checkpoint = tf.train.Checkpoint(
      optimizer=protocols.checkpointed_optimizer(trainer))
  with tempfile.TemporaryDirectory() as folder:
    reader = tf.train.load_checkpoint(checkpoint.write(f"{folder}/ckpt"))
    return {k: reader.get_tensor(k)
            for k in reader.get_variable_to_shape_map()
            if k.startswith("optimizer/")}


def device_bytes(variables, strategy):
  """{device: bytes} of the variables' copies, from their own devices."""
  total = {}
  for variable in variables:
    for copy in strategy.experimental_local_results(
        getattr(variable, "value", variable)):
      total[copy.device] = total.get(copy.device, 0) + (
          copy.shape.num_elements() * copy.dtype.size)
  return total


@pytest.fixture(scope="module")
def unsharded(data):
  """(optimizer, learning_rate) -> (trainer, weights, metrics) of STEPS
  unsharded mirrored steps, each trained once: Adam's is also the
  checkpoint tests' continuous run."""
  runs = {}

  def run(optimizer, learning_rate):
    if (optimizer, learning_rate) not in runs:
      trainer = make_trainer("mirrored", optimizer=optimizer,
                             learning_rate=learning_rate)
      runs[optimizer, learning_rate] = (trainer,
                                        *train(trainer, data, steps=STEPS))
    return runs[optimizer, learning_rate]

  return run


@pytest.mark.parametrize("optimizer,learning_rate", CASES)
def test_sharded_weights_and_slots_equal_the_unsharded_run(
    data, unsharded, optimizer, learning_rate):
  plain, plain_weights, plain_metrics = unsharded(optimizer, learning_rate)
  sharded = make_trainer("mirrored", optimizer=optimizer,
                         learning_rate=learning_rate,
                         shard_optimizer_state=True)
  assert sharded.optimizer_sharding is not None
  weights, metrics = train(sharded, data, steps=STEPS)
  assert max_diff(plain_weights, weights) < 1e-6
  for name in ("loss", "grad_norm"):
    assert metrics[name] == pytest.approx(plain_metrics[name], abs=1e-6)
  # Both replicas hold the same (gathered) weights.
  for variable in sharded.model.trainable_variables:
    a, b = sharded.strategy.experimental_local_results(variable.value)
    np.testing.assert_array_equal(a.numpy(), b.numpy())
  # The slots, gathered for the checkpoint, are the unsharded run's.
  a, b = full_slots(plain), full_slots(sharded)
  assert a.keys() == b.keys() and len(a) > 4
  assert max(float(np.abs(a[k] - b[k]).max()) for k in a) < 1e-6
  assert int(sharded.optimizer.iterations.numpy()) == STEPS
  # The weights moved.
  assert max_diff(weights, train(make_trainer(
      "mirrored", optimizer=optimizer), data, steps=0)[0]) > 1e-4


@pytest.mark.parametrize("optimizer,learning_rate",
                         [("momentum", 0.05), ("adam", 1e-3)])
def test_jit_compiled_sharded_update_equals_the_plain_one(
    data, unsharded, optimizer, learning_rate):
  # `jit_compile` and `shard_optimizer_state` together: the XLA-compiled
  # sharded update gives the unsharded, uncompiled run's weights.
  _, plain_weights, plain_metrics = unsharded(optimizer, learning_rate)
  both = make_trainer("mirrored", optimizer=optimizer,
                      learning_rate=learning_rate,
                      shard_optimizer_state=True, jit_compile=True)
  assert both.optimizer_sharding is not None and both.jit_compile
  weights, metrics = train(both, data, steps=STEPS)
  # XLA fuses differently: equal to float32 rounding, not bit for bit.
  assert max_diff(plain_weights, weights) < 1e-5
  assert metrics["loss"] == pytest.approx(plain_metrics["loss"], abs=1e-5)


def test_each_device_holds_half_of_the_slots(data):
  plain = make_trainer("mirrored", optimizer="adam", learning_rate=1e-3)
  sharded = make_trainer("mirrored", optimizer="adam", learning_rate=1e-3,
                         shard_optimizer_state=True)
  params = device_bytes(plain.model.trainable_variables, plain.strategy)
  full = device_bytes(plain.optimizer.variables, plain.strategy)
  shard = device_bytes(sharded.optimizer_sharding.slot_variables(),
                       sharded.strategy)
  assert len(shard) == 2 and shard.keys() == params.keys()
  for device, size in shard.items():
    # Adam: 2 slots; padding adds at most one element per variable.
    assert full[device] > 2 * params[device]
    assert size <= params[device] + 2 * 4 * len(
        plain.model.trainable_variables)
    assert 0.45 * full[device] < size < 0.55 * full[device]


def test_clipping_uses_the_full_gradient_norm(data):
  plain, sharded = [make_trainer("mirrored", optimizer="momentum",
                                 clip_norm=0.05, shard_optimizer_state=s)
                    for s in (False, True)]
  (a, am), (b, bm) = [train(t, data, steps=3) for t in (plain, sharded)]
  assert am["grad_norm"] > 0.05  # clipping was active
  assert bm["grad_norm"] == pytest.approx(am["grad_norm"], abs=1e-6)
  assert max_diff(a, b) < 1e-6


@pytest.mark.parametrize("first,second", [(True, False), (False, True)])
def test_a_checkpoint_resumes_with_sharding_toggled(data, unsharded, tmp_path,
                                                    first, second):
  _, expected, _ = unsharded("adam", 1e-3)
  trainer = make_trainer("mirrored", optimizer="adam", learning_rate=1e-3,
                         shard_optimizer_state=first)
  iterator = iter(framework.data.inputs.distribute_train(
      trainer.strategy, data, 32, seed=3))
  trainer.train(iterator, STEPS // 2)
  path = tf.train.Checkpoint(
      model=trainer.model,
      optimizer=protocols.checkpointed_optimizer(
          trainer)).save(str(tmp_path / "ckpt"))
  resumed = make_trainer("mirrored", optimizer="adam", learning_rate=1e-3,
                         shard_optimizer_state=second)
  tf.train.Checkpoint(
      model=resumed.model,
      optimizer=protocols.checkpointed_optimizer(
          resumed)).restore(path).assert_existing_objects_matched()
  assert int(resumed.optimizer.iterations.numpy()) == STEPS // 2
  # The same data from where the first half stopped.
  iterator = iter(framework.data.inputs.distribute_train(
      resumed.strategy, data, 32, seed=3))
  for _ in range(STEPS // 2):
    next(iterator)
  resumed.train(iterator, STEPS - STEPS // 2)
  weights = [v.numpy() for v in resumed.model.trainable_variables]
  assert max_diff(expected, weights) < 1e-6


def test_one_replica_is_a_no_op_and_other_strategies_are_one_line():
  assert make_trainer("one_device", shard_optimizer_state=True
                      ).optimizer_sharding is None
  with pytest.raises(ConfigError, match="central_storage|CentralStorage"):
    make_trainer("central_storage", shard_optimizer_state=True)
  strategy = framework.make_strategy("mirrored")
  with strategy.scope():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    optimizer = keras.optimizers.RMSprop()
  with pytest.raises(ConfigError, match="RMSprop is not one whose update"):
    framework.Trainer(model, optimizer, strategy, global_batch_size=4,
                      shard_optimizer_state=True)
