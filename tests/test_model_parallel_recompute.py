"""Recomputation, balance by work, activation memory (issue 13, items 4-6)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from framework import model_parallel as mp
from framework.errors import ConfigError
from framework.model_parallel.pipeline import layer_costs
from tests.model_parallel_reference import (DEVICES, STRATEGY, assert_close,
                                            build, data)

BATCH, MICRO = 16, 4


def _pipeline(model, **kwargs):
  kwargs.setdefault("num_stages", 2)
  kwargs.setdefault("num_microbatches", MICRO)
  kwargs.setdefault("global_batch_size", BATCH)
  kwargs.setdefault("devices", DEVICES)
  return mp.PipelineTrainer(model, keras.optimizers.Adam(1e-2), STRATEGY,
                            **kwargs)


def _gradients(make_model, x, y, **kwargs):
  """Gradients of a fresh pipeline without and with recomputation."""
  results = []
  for recompute in (False, True):
    trainer = _pipeline(make_model(), recompute=recompute, **kwargs)
    results.append((trainer, tf.function(trainer.gradients)(x, y)))
  return results


def _assert_same(results, atol=1e-6):
  (_, (plain, plain_loss, _)), (_, (again, again_loss, _)) = results
  assert len(plain) == len(again)
  assert_close(again_loss, plain_loss, "loss", atol=atol)
  for i, (a, b) in enumerate(zip(again, plain)):
    assert float(tf.reduce_max(tf.abs(b))) > 0, f"gradient {i} is zero"
    assert_close(a, b, f"gradient {i}", atol=atol)


def test_recompute_mlp_pipeline_gives_the_same_gradients():
  x, y = data(BATCH, (12,), 5)
  results = _gradients(lambda: build("mlp", (12,), 5, hidden_units=(16, 16)),
                       x, y)
  _assert_same(results)
  # The recomputing pipeline keeps no tape per micro-batch: the stage's
  # forward ops appear twice in the step (once per micro-batch, once again
  # in the backward pass).
  trainer = results[1][0]
  graph = tf.function(trainer.gradients).get_concrete_function(
      tf.TensorSpec(x.shape, tf.float32), tf.TensorSpec(y.shape,
                                                         tf.int32)).graph
  for scope, ops in mp.ops_by_scope(graph, {"stage_1": 0}).items():
    forward = [op for op in ops if op.type == "MatMul" and
               not op.name.startswith("gradient_tape/")]
    assert len(forward) == 2 * 2 * MICRO, [op.name for op in forward]


def _skip_model(dropout=0.0, seed=1):
  """a -> b -> BN -> c -> add(c, a) -> out: a skip across the cut."""
  keras.utils.set_random_seed(seed)
  inputs = keras.Input((6,))
  a = keras.layers.Dense(8, activation="tanh", name="a")(inputs)
  b = keras.layers.Dense(8, activation="tanh", name="b")(a)
  b = keras.layers.BatchNormalization(name="bn")(b)
  if dropout:
    b = keras.layers.Dropout(dropout, name="drop")(b)
  c = keras.layers.Dense(8, activation="tanh", name="c")(b)
  joined = keras.layers.Add(name="join")([c, a])
  outputs = keras.layers.Dense(4, name="out")(joined)
  return keras.Model(inputs, outputs, name="skip")


@pytest.mark.parametrize("dropout", [0.0, 0.5])
def test_recompute_functional_skip_model_gives_the_same_gradients_and_state(
    dropout):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(8, 6)).astype(np.float32)
  y = rng.integers(0, 4, size=8).astype(np.int32)
  results = _gradients(lambda: _skip_model(dropout), x, y,
                       stage_boundaries=("bn",), global_batch_size=8,
                       num_microbatches=2)
  # Dropout too: the recomputed pass sees the seed state of the original
  # one, so it draws the same masks.
  _assert_same(results)
  # BatchNorm statistics are updated once per micro-batch, as without
  # recomputation (the recomputed pass's update is undone).
  (plain, _), (again, _) = results
  for a, b in zip(again.model.non_trainable_variables,
                  plain.model.non_trainable_variables):
    assert_close(a.numpy(), b.numpy(), b.path, atol=0)


def test_recompute_unet_pipeline_gives_the_same_gradients():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(4, 16, 16, 3)).astype(np.float32)
  y = rng.integers(0, 3, size=(4, 16, 16)).astype(np.int32)
  results = _gradients(
      lambda: build("unet", (16, 16, 3), 3, seed=1, depth=2, width=4), x, y,
      global_batch_size=4, num_microbatches=2)
  _assert_same(results)


def test_recompute_keeps_only_the_stage_inputs():
  def memory(recompute):
    return _pipeline(build("mlp", (12,), 5, hidden_units=(16, 16)),
                     recompute=recompute).memory
  plain, again = memory(False), memory(True)
  # Stage 0: Flatten, Dense 16 on a 12-float input; stage 1: Dense 16,
  # Dense 5 on stage 0's 16-float output. Bytes for the whole batch (all
  # M micro-batches are in flight before the first backward pass).
  floats = 4 * BATCH
  assert plain["/CPU:0"]["activation_bytes"] == (12 + 12 + 16) * floats
  assert plain["/CPU:1"]["activation_bytes"] == (16 + 16 + 5) * floats
  assert again["/CPU:0"]["activation_bytes"] == 12 * floats
  assert again["/CPU:1"]["activation_bytes"] == 16 * floats
  for device in DEVICES:
    assert again[device]["activation_bytes"] < plain[device][
        "activation_bytes"]
  assert mp.memory_metrics(again)["memory/CPU_1/activation_bytes"] == (
      16 * floats)
  assert "activations 1024 B" in mp.format_memory(again)


def test_graph_stage_activation_bytes_count_skip_inputs():
  model = _skip_model()
  trainer = _pipeline(model, stage_boundaries=("c",), global_batch_size=8,
                      num_microbatches=2)
  # Stage 1 reads the BN output and the skip `a`: 8 + 8 floats per example.
  assert trainer.stages[1].activation_bytes(recompute=True) == 16 * 4
  assert trainer.memory["/CPU:1"]["activation_bytes"] == 8 * 4 * (
      8 + 8 + 8 + 8 + 4)


def _conv_then_big_dense(seed=1):
  """Convs (little memory, much work) then a big Dense (the reverse)."""
  keras.utils.set_random_seed(seed)
  return keras.Sequential([
      keras.Input((8, 8, 4)),
      keras.layers.Conv2D(16, 3, padding="same", name="conv_a"),
      keras.layers.Conv2D(16, 3, padding="same", name="conv_b"),
      keras.layers.Conv2D(16, 3, padding="same", name="conv_c"),
      keras.layers.Flatten(name="flatten"),
      keras.layers.Dense(64, name="big_dense"),
      keras.layers.Dense(5, name="logits"),
  ])


def test_a_layer_after_only_weightless_layers_needs_no_input_gradient():
  model = build("mlp", (12,), 5, hidden_units=(16, 16))
  # Flatten, then the first Dense: forward + weight gradient only.
  assert layer_costs(model.layers)[:2] == [0, 2 * 12 * 16 * 2]
  assert layer_costs(model.layers)[2] == 2 * 16 * 16 * 3


def test_flops_balance_cuts_by_work_not_parameters():
  model = _conv_then_big_dense()
  # Multiply-adds per example: conv 8*8*16*3*3*Cin, dense Cin*units.
  macs = [8 * 8 * 16 * 9 * 4, 8 * 8 * 16 * 9 * 16, 8 * 8 * 16 * 9 * 16, 0,
          1024 * 64, 64 * 5]
  # Training = forward + weight gradient (+ input gradient, all but the
  # first layer): 2 FLOPs per multiply-add.
  flops = [2 * m * (2 if i == 0 else 3) for i, m in enumerate(macs)]
  assert layer_costs(model.layers) == flops
  # The hand-computed optimum: the cut with the smallest larger half.
  worst = [max(sum(flops[:k]), sum(flops[k:])) for k in range(1, 6)]
  best = 1 + worst.index(min(worst))
  assert best == 2  # conv_a, conv_b | conv_c, flatten, big_dense, logits
  assert _pipeline(_conv_then_big_dense()).boundaries == (best,)
  # By parameters, the big Dense (65 600 of 71 157) ends up in the second
  # stage with no conv work left beside it; all three convs go first (a cut
  # before flatten or before big_dense ties; the first is taken).
  by_params = _pipeline(_conv_then_big_dense(), stage_balance="params")
  assert by_params.boundaries == (3,)
  # The override still wins.
  assert _pipeline(_conv_then_big_dense(),
                   stage_boundaries=("flatten",)).boundaries == (3,)


def test_bad_balance_and_recompute_without_a_split_are_one_clear_error():
  with pytest.raises(ConfigError, match="stage_balance='time' is not valid"):
    _pipeline(_conv_then_big_dense(), stage_balance="time")
  with pytest.raises(ConfigError, match="recompute re-runs"):
    mp.ModelParallelConfig(recompute=True)
  config = mp.ModelParallelConfig(mode="pipeline", recompute=True,
                                  stage_balance="params")
  assert config.trainer_factory().keywords["recompute"] is True
  assert config.trainer_factory().keywords["stage_balance"] == "params"
