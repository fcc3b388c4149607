"""--shard_gradients (ZeRO-2) on 2 mirrored replicas: the unsharded run's
weights and slots, with and without gradient accumulation; each replica
holds (and accumulates) only its half of the reduced gradient; checkpoints
that either layout restores; bad combinations are one ConfigError."""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

import framework
import models
from framework.core import gradients, protocols, updates
from framework.errors import ConfigError
from test_optimizer_sharding import full_slots

# A size and seed of their own: 5x3x2 inputs (30 features) into 13 hidden
# units (the hidden bias has an odd size: its halves are padded). Clipping
# acts (the gradient's norm is above CLIP): it sees the whole norm.
SHAPE, HIDDEN, SEED, BATCH, STEPS, CLIP = (5, 3, 2), (13,), 63, 24, 5, 0.5
CASES = [("momentum", 0.05), ("adam", 2e-3)]


@pytest.fixture(scope="module")
def data():
  return framework.data.datasets.synthetic(
      num_train=240, num_test=10, image_shape=SHAPE, seed=SEED)


def make(strategy="mirrored", optimizer="momentum", learning_rate=0.05,
         **kwargs):
  strategy = framework.make_strategy(strategy)
  keras.utils.set_random_seed(SEED)
  with strategy.scope():
    net = models.build_model("mlp", SHAPE, 10, hidden_units=HIDDEN,
                             dropout=False)
    opt = framework.core.optimizers.make_optimizer(framework.OptimizerConfig(
        name=optimizer, learning_rate=learning_rate))
  return framework.Trainer(net, opt, strategy, global_batch_size=BATCH,
                           **kwargs)


def batches(trainer, data, skip=0):
  iterator = iter(framework.data.inputs.distribute_train(
      trainer.strategy, data, BATCH, seed=SEED))
  for _ in range(skip):
    next(iterator)
  return iterator


def weights_of(trainer):
  return [v.numpy() for v in trainer.model.trainable_variables]


def max_diff(a, b):
  return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def unsharded(data):
  """(optimizer, lr) -> (trainer, weights) of STEPS unsharded steps."""
  runs = {}

  def run(optimizer, learning_rate):
    if (optimizer, learning_rate) not in runs:
      trainer = make(optimizer=optimizer, learning_rate=learning_rate,
                     clip_norm=CLIP)
      trainer.train(batches(trainer, data), STEPS)
      runs[optimizer, learning_rate] = trainer, weights_of(trainer)
    return runs[optimizer, learning_rate]

  return run


def gradient_shapes(monkeypatch, trainer):
  """Records, while the step is traced, the shapes of the gradients
  `accumulate_gradients` returns (the accumulator's) and of those the
  update receives: {"accumulated": [[shape]], "applied": [[shape]]}."""
  seen = {"accumulated": [], "applied": []}
  accumulate = gradients.GradientPipeline.accumulate_gradients

  def accumulated(self, *args, **kwargs):
    grads, metrics = accumulate(self, *args, **kwargs)
    seen["accumulated"].append([tuple(g.shape) for g in grads])
    return grads, metrics

  monkeypatch.setattr(gradients.GradientPipeline, "accumulate_gradients",
                      accumulated)
  apply = trainer.updater.apply

  def applied(grads, *args, **kwargs):
    seen["applied"].append([tuple(g.shape) for g in grads])
    return apply(grads, *args, **kwargs)

  monkeypatch.setattr(trainer.updater, "apply", applied)
  return seen


def nbytes(shapes):
  return sum(4 * math.prod(s) for s in shapes)


@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("optimizer,learning_rate", CASES)
def test_sharded_gradients_equal_the_unsharded_run_at_half_the_bytes(
    data, unsharded, monkeypatch, optimizer, learning_rate, accum):
  plain, expected = unsharded(optimizer, learning_rate)
  trainer = make(optimizer=optimizer, learning_rate=learning_rate,
                 shard_optimizer_state=True, shard_gradients=True,
                 grad_accum_steps=accum, clip_norm=CLIP)
  assert type(trainer.updater) is updates.ShardedGradientsUpdate
  seen = gradient_shapes(monkeypatch, trainer)
  trainer.train(batches(trainer, data), STEPS)
  weights = weights_of(trainer)
  assert max_diff(expected, weights) < 1e-6
  assert max_diff(expected, weights_of(make())) > 1e-3  # they moved
  a, b = full_slots(plain), full_slots(trainer)
  assert a.keys() == b.keys() and len(a) >= 4
  assert max(float(np.abs(a[k] - b[k]).max()) for k in a) < 1e-6
  # The gradient each replica accumulates and hands to the update: its
  # [ceil(n/2)] half of each variable's, counted against the whole.
  whole = [tuple(v.shape) for v in trainer.model.trainable_variables]
  halves = [(math.ceil(math.prod(s) / 2),) for s in whole]
  assert seen["applied"] and seen["accumulated"]
  for shapes in seen["applied"] + seen["accumulated"]:
    assert shapes == halves
  assert nbytes(halves) == 1088 and nbytes(whole) == 2172


def test_zero1_alone_accumulates_the_whole_gradient(data, monkeypatch):
  # What --shard_gradients changes: without it, the accumulator is whole.
  trainer = make(shard_optimizer_state=True, grad_accum_steps=2)
  seen = gradient_shapes(monkeypatch, trainer)
  trainer.train(batches(trainer, data), 1)
  whole = [tuple(v.shape) for v in trainer.model.trainable_variables]
  assert seen["accumulated"] and all(s == whole for s in seen["accumulated"])


@pytest.mark.parametrize("first,second", [(True, False), (False, True)])
def test_a_checkpoint_resumes_with_gradient_sharding_toggled(
    data, unsharded, tmp_path, first, second):
  _, expected = unsharded("adam", 2e-3)
  options = lambda on: dict(shard_optimizer_state=on, shard_gradients=on,
                            grad_accum_steps=2 if on else 1)
  trainer = make(optimizer="adam", learning_rate=2e-3, clip_norm=CLIP,
                 **options(first))
  assert trainer.updater.scatters_micro_batches is first
  trainer.train(batches(trainer, data), 2)
  path = tf.train.Checkpoint(
      model=trainer.model, optimizer=protocols.checkpointed_optimizer(
          trainer)).save(str(tmp_path / "ckpt"))
  resumed = make(optimizer="adam", learning_rate=2e-3, clip_norm=CLIP,
                 **options(second))
  tf.train.Checkpoint(
      model=resumed.model, optimizer=protocols.checkpointed_optimizer(
          resumed)).restore(path).assert_existing_objects_matched()
  assert resumed.updater.scatters_micro_batches is second
  resumed.train(batches(resumed, data, skip=2), STEPS - 2)
  assert max_diff(expected, weights_of(resumed)) < 1e-6


def test_bad_combinations_are_one_config_error():
  with pytest.raises(ConfigError, match=r"shard_gradients=True needs "
                     r"shard_optimizer_state=True"):
    make(shard_gradients=True)
  with pytest.raises(ConfigError, match=r"shard_gradients=True .*all_reduce"):
    make(shard_optimizer_state=True, shard_gradients=True,
         all_reduce=framework.AllReduceConfig(dtype="bfloat16"))
  with pytest.raises(ConfigError, match="central_storage|CentralStorage"):
    make("central_storage", shard_optimizer_state=True, shard_gradients=True)
  # One replica: nothing to shard, as for the optimizer state.
  assert make("one_device", shard_optimizer_state=True,
              shard_gradients=True).optimizer_sharding is None
