"""Weight decay by parameter group: AdamW decays kernels only (biases, norms
and embeddings not) unless --weight_decay_exclude says otherwise; ZeRO-1's
shards and a mesh's copies follow the same groups."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import framework
from framework import ConfigError
from framework.core.config import TrainerConfig
from tests import helpers
from tests.transformer_split_reference import (BATCH, tiny_gpt,
                                               token_batches)

LEARNING_RATE, WEIGHT_DECAY = 0.1, 0.5


class ZeroGradient(framework.Trainer):
  """A step whose gradient is zero: only the weight decay moves weights."""

  def compute_loss(self, batch):
    per_example, metrics = super().compute_loss(batch)
    return 0.0 * per_example, metrics


def one_step(strategy_name, **kwargs):
  """{path: (before, after)} over one zero-gradient AdamW step."""
  strategy = framework.make_strategy(strategy_name)
  with strategy.scope():
    model = tiny_gpt(num_layers=1)
    optimizer = keras.optimizers.AdamW(LEARNING_RATE,
                                       weight_decay=WEIGHT_DECAY)
  trainer = ZeroGradient(model, optimizer, strategy, global_batch_size=BATCH,
                         **kwargs)
  before = {v.path: v.numpy() for v in model.trainable_variables}
  x, y = token_batches(1)
  batches = strategy.experimental_distribute_dataset(
      tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH))
  trainer.train(iter(batches), 1)
  return {v.path: (before[v.path], v.numpy())
          for v in model.trainable_variables}


def informative(weights):
  """The paths whose decay shows (not zero, as biases start)."""
  return {p for p, (before, _) in weights.items() if np.any(before)}


def decayed_paths(weights):
  """The paths the step decayed; every other variable must not move."""
  out = set()
  for path, (before, after) in weights.items():
    if np.array_equal(before, after):
      continue
    np.testing.assert_allclose(
        after, before * (1 - LEARNING_RATE * WEIGHT_DECAY), rtol=1e-6,
        err_msg=path)
    out.add(path)
  return out


KERNELS = {"block_0/attention/query/kernel", "block_0/attention/key/kernel",
           "block_0/attention/value/kernel", "block_0/attention/out/kernel",
           "block_0/mlp/fc/kernel", "block_0/mlp/proj/kernel"}


@pytest.mark.parametrize("strategy,kwargs", [
    ("default", {}),
    ("mirrored", {}),
    ("mirrored", {"shard_optimizer_state": True}),  # ZeRO-1's shards
])
def test_only_kernels_are_decayed_by_default(strategy, kwargs):
  weights = one_step(strategy, **kwargs)
  assert decayed_paths(weights) == KERNELS
  assert {"token_embedding/embeddings", "position_embedding/positions",
          "block_0/ln1/gamma"} <= informative(weights) - KERNELS


@pytest.mark.parametrize("exclude,expected", [
    ("^$", "all"),
    ("kernel|ln", "none but embeddings, biases"),
])
def test_the_pattern_replaces_the_default(exclude, expected):
  weights = one_step("mirrored", shard_optimizer_state=True,
                     weight_decay_exclude=exclude)
  if expected == "all":
    assert decayed_paths(weights) == informative(weights)
  else:
    assert decayed_paths(weights) == {
        p for p in informative(weights) if "kernel" not in p and "ln" not in p}
  assert "token_embedding/embeddings" in decayed_paths(weights)


def test_the_groups_are_logged_by_name(caplog):
  with caplog.at_level("INFO", logger="absl"):
    one_step("default")
  lines = [r.getMessage() for r in caplog.records
           if r.getMessage().startswith("weight decay")]
  assert len(lines) == 2, lines
  assert lines[0].startswith("weight decay 0.5, decayed (6): ")
  assert "block_0/mlp/fc/kernel" in lines[0]
  assert lines[1].startswith("weight decay 0.5, not decayed (14): ")
  assert "token_embedding/embeddings" in lines[1]


def test_a_bad_pattern_is_a_config_error():
  with pytest.raises(ConfigError, match=r"weight_decay_exclude='\(bias' is "
                     "not a regular expression"):
    TrainerConfig(weight_decay_exclude="(bias")


@pytest.mark.parametrize("value", [-0.1, float("nan"), float("inf")])
def test_a_negative_or_nonfinite_decay_is_a_config_error(value):
  # -0.1 would grow the weights; nan only showed as a nan loss mid-run.
  with pytest.raises(ConfigError, match=rf"weight_decay={value} must be a "
                     "number >= 0"):
    framework.OptimizerConfig(name="adamw", weight_decay=value)


_MESHES = """
import json
import framework
framework.configure_cpu_devices(4)
import keras
import tensorflow as tf
from framework import model_parallel as mp
from models import gpt_parallel
from tests.model_parallel_reference import STRATEGY
from tests.transformer_split_reference import (BATCH, flat, relative,
                                               tiny_gpt, token_batches)
STEPS = 3
GROUPS = [["/CPU:0", "/CPU:1"], ["/CPU:2", "/CPU:3"]]

def adamw():
  return keras.optimizers.AdamW(1e-2, weight_decay=0.5)

def trained(trainer, weights):
  x, y = token_batches(STEPS)
  trainer.train(iter(tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)),
                STEPS)
  return flat(weights(trainer))

unsplit = lambda t: gpt_parallel.logical_weights(t.model)
plain = trained(framework.Trainer(tiny_gpt(num_layers=1), adamw(), STRATEGY,
                                  global_batch_size=BATCH), unsplit)
every = trained(framework.Trainer(tiny_gpt(num_layers=1), adamw(), STRATEGY,
                                  global_batch_size=BATCH,
                                  weight_decay_exclude="^$"), unsplit)
out = {"groups": relative(every, plain)}
for shard in (False, True):
  mesh = mp.TensorParallelTrainer(
      tiny_gpt(num_layers=1), adamw(), STRATEGY, global_batch_size=BATCH,
      replica_devices=GROUPS, shard_optimizer_state=shard, num_shards=2,
      tensor_stages=1)
  out[f"mesh {shard}"] = relative(
      trained(mesh, lambda t: t.model.logical_weights()), plain)
  out[f"copy {shard}"] = relative(flat(mesh.copies[0][1].logical_weights()),
                                  plain)
print("RESULT " + json.dumps(out))
"""


@pytest.mark.slow
def test_the_split_and_sharded_runs_equal_the_plain_run():
  # data:2,model:2: two copies of a 2-way tensor split, with and without
  # the optimizer state sharded over the copies.
  out = helpers.run_result(_MESHES, timeout=1200)
  print(out)
  # The groups move the weights by ~1e-2; the split's float noise (zero-
  # gradient key biases, which Adam scales up) by ~5e-5.
  assert out["groups"] > 1e-2, out
  for shard in (False, True):
    assert out[f"mesh {shard}"] < 1e-3, out
    assert out[f"copy {shard}"] < 1e-3, out
