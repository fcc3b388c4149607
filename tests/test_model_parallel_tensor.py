"""Tensor parallelism: a hidden layer of 10 units as 5 + 5 on two devices."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import framework
from framework import model_parallel as mp
from framework.errors import ConfigError
from tests.model_parallel_reference import (DEVICES, STRATEGY, assert_close,
                                            batches, build, data,
                                            unsplit_gradients)

BATCH, ADAM_STEPS = 16, 5
SHAPE, CLASSES = (12,), 5


def _tensor_parallel(model, **kwargs):
  kwargs.setdefault("devices", DEVICES)
  return mp.TensorParallelTrainer(model, keras.optimizers.Adam(1e-2),
                                  STRATEGY, global_batch_size=BATCH, **kwargs)


def _as_unsplit(placed, value_of):
  """The split model's values in the unsplit model's weight order.

  `value_of(variable)` gives a numpy value (the weight or its gradient);
  column shards are joined along the units, row shards along the inputs.
  """
  def values(layers):
    return [value_of(v) for layer in layers for v in layer.weights]

  column, row = placed.column, placed.row
  joined = [
      np.concatenate([value_of(s.kernel) for s in column.shards], axis=1),
      np.concatenate([value_of(s.bias) for s in column.shards], axis=0),
      np.concatenate([value_of(s.kernel) for s in row.shards], axis=0),
      value_of(row.output_layer.bias)]
  return values(placed.before) + joined + values(placed.after)


def test_hidden_layer_of_10_as_5_plus_5_equals_unsplit():
  x, y = data(BATCH, SHAPE, CLASSES)
  reference = framework.Trainer(build("mlp", SHAPE, CLASSES,
                                      hidden_units=(10,)),
                                keras.optimizers.Adam(1e-2), STRATEGY,
                                global_batch_size=BATCH)
  split = _tensor_parallel(build("mlp", SHAPE, CLASSES, hidden_units=(10,)))
  placed = split.model
  assert [s.units for s in placed.column.shards] == [5, 5]
  assert [s.kernel.shape for s in placed.row.shards] == [(5, CLASSES)] * 2
  assert [mp.variable_device(s.kernel) for s in placed.column.shards] == [
      "/CPU:0", "/CPU:1"]
  assert [mp.variable_device(s.kernel) for s in placed.row.shards] == [
      "/CPU:0", "/CPU:1"]

  # Forward: the Keras model and the staged forward both equal the unsplit.
  expected = reference.model(x, training=False)
  assert_close(placed(x), expected, "forward (model)")
  assert_close(split.forward(x), expected, "forward (stages)")

  # Gradients, mapped back onto the unsplit weights.
  ref_grads = tf.function(unsplit_gradients)(reference.model, x, y, BATCH)[0]
  grads = tf.function(split.gradients)(x, y)[0]
  by_variable = {id(v): g.numpy() for v, g in zip(split.variables, grads)}
  joined = _as_unsplit(placed, lambda v: by_variable[id(v)])
  for var, got, want in zip(reference.model.trainable_variables, joined,
                            ref_grads):
    assert_close(got, want, f"gradient of {var.path}")

  # Weights after 5 Adam steps.
  reference.train(batches(x, y), ADAM_STEPS)
  split.train(batches(x, y), ADAM_STEPS)
  joined = _as_unsplit(placed, lambda v: v.numpy())
  assert len(joined) == len(reference.model.weights)
  for var, got in zip(reference.model.weights, joined):
    assert_close(got, var.numpy(), f"{var.path} after {ADAM_STEPS} steps")
  # The exported (reassembled) model is the unsplit one, weights and all.
  exported = split.export_model()
  for var, got in zip(reference.model.weights, exported.weights):
    assert_close(got.numpy(), var.numpy(), f"exported {var.path}")
  assert_close(exported(x), placed(x), "exported forward")


def test_shard_ops_forward_and_backward_are_on_their_devices():
  x, y = data(BATCH, SHAPE, CLASSES)
  split = _tensor_parallel(build("mlp", SHAPE, CLASSES, hidden_units=(8, 10)))
  assert split.split_layer == 2  # the last Dense followed by a Dense
  step = tf.function(lambda batch: split.strategy.run(split.train_step,
                                                      args=(batch,)))
  graph = step.get_concrete_function(
      (tf.TensorSpec(x.shape, tf.float32),
       tf.TensorSpec(y.shape, tf.int32))).graph
  devices = {"stage_0": "/CPU:0", "shard_0": "/CPU:0", "shard_1": "/CPU:1",
             "stage_1": "/CPU:0", "stage_2": "/CPU:0"}
  offenders = mp.misplaced_ops(graph, devices)
  assert not offenders, "ops off their device:\n" + "\n".join(offenders[:50])
  shard_1 = [op.name for op in mp.ops_by_scope(graph, ["shard_1"])["shard_1"]
             if op.type == "MatMul"]
  # Forward: column and row matmul; backward: two matmuls each.
  assert len([n for n in shard_1 if n.startswith("gradient_tape/")]) == 4
  assert len([n for n in shard_1 if not n.startswith("gradient_tape/")]) == 2
  # The split halves the two layers' parameters and slots across devices.
  memory = split.memory
  assert memory["/CPU:1"]["param_bytes"] == 4 * (8 * 5 + 5 + 5 * CLASSES)
  assert memory["/CPU:1"]["optimizer_slot_bytes"] == 2 * memory["/CPU:1"][
      "param_bytes"]


@pytest.mark.parametrize("model, kwargs, message", [
    (("mlp", dict(hidden_units=(9,))), {}, "9 units, which cannot be split"),
    (("mlp", dict(hidden_units=(10,))), dict(split_layer=0),
     r"split_layer=0 \(Flatten followed by Dense\) cannot be split"),
    (("mlp", dict(hidden_units=(12,))), dict(num_shards=3, devices=None),
     "num_shards=3 needs 3 devices but only 2"),
    (("cifar_cnn", dict(dropout=True)), {}, "Dropout in between"),
])
def test_invalid_splits_are_one_clear_error(model, kwargs, message):
  name, options = model
  shape = (32, 32, 3) if name == "cifar_cnn" else SHAPE
  with pytest.raises(ConfigError, match=message):
    _tensor_parallel(build(name, shape, CLASSES, **options), **kwargs)
