"""Tensor parallelism of a whole transformer: the tiny GPT split by heads,
MLP columns/rows and vocabulary equals the unsplit GPT.

In-process tests have 2 logical CPU devices (conftest); the 4- and
8-device splits (tensor 4-way, data 2 x tensor 2, tensor x pipeline, all
three axes) run in one fresh process of 8, shared by the module's tests.
"""

import collections

import keras
import numpy as np
import pytest
import tensorflow as tf

from framework import model_parallel as mp
from framework.errors import ConfigError
from models import gpt_parallel
from tests import helpers
from tests.model_parallel_reference import unsplit_gradients
from tests.transformer_split_reference import (BATCH, LENGTH, STRATEGY,
                                               compare, tiny_gpt,
                                               token_batches)

TOLERANCE = 1e-5
STEPS = 3


def _check(out):
  assert out["forward"] < TOLERANCE, out
  assert max(out["loss"]) < TOLERANCE, out
  assert max(out["weights"]) < TOLERANCE, out
  assert out["moved"] > 1e-2, out  # the steps changed the weights


def test_two_way_split_equals_unsplit():
  out = compare(STEPS, 2)
  _check(out)
  assert out["devices"] == ["/CPU:0", "/CPU:1"]
  placed = out["trainer"].model
  query = placed.blocks[0].attention.query
  assert [tuple(v.shape) for v in query.kernel_shards] == [(32, 16)] * 2
  assert [mp.variable_device(v) for v in query.kernel_shards] == [
      "/CPU:0", "/CPU:1"]
  assert [tuple(v.shape) for v in placed.embedding.table_shards] == [
      (32, 32)] * 2


def test_every_shard_runs_forward_and_backward_on_its_device():
  trainer = mp.TensorParallelTrainer(
      tiny_gpt(), keras.optimizers.SGD(0.1), STRATEGY,
      global_batch_size=BATCH, num_shards=2, devices=["/CPU:0", "/CPU:1"])
  graph = tf.function(trainer.gradients).get_concrete_function(
      tf.TensorSpec((BATCH, LENGTH), tf.int32),
      tf.TensorSpec((BATCH, LENGTH), tf.int32)).graph
  ops = graph.get_operations()
  where = lambda op: op.device.split("device:")[-1]
  collectives = collections.Counter(
      where(op) for op in ops if op.type == "CollectiveReduceV2")
  # Per device: each of the 2 blocks' 2 sub-layers one all-reduce forward
  # and one backward, the embedding one each way, the loss statistics one
  # all-gather each way, the accuracy's one forward: 2 * 2 * 2 + 2 + 2 + 1.
  assert collectives == {"CPU:0": 13, "CPU:1": 13}
  # The matmuls of both passes (the forward ones and their gradients) of
  # every shard are on that shard's device: as many on each.
  matmuls = collections.Counter(
      where(op) for op in ops
      if op.type in ("MatMul", "BatchMatMulV2", "Einsum"))
  assert set(matmuls) == {"CPU:0", "CPU:1"}, matmuls
  assert matmuls["CPU:0"] == matmuls["CPU:1"], matmuls
  # No gradient op of shard 1's attention lands on device 0.
  misplaced = [op.name for op in ops if where(op) == "CPU:0" and
               "shard_1" in op.name]
  assert not misplaced, misplaced[:5]


def _largest_tensor(graph):
  """(elements, op name) of the largest statically shaped op output."""
  return max((t.shape.num_elements() or 0, op.name)
             for op in graph.get_operations() for t in op.outputs)


def test_the_split_step_makes_no_tensor_larger_than_the_unsplit_step():
  # Issue 36: tf.einsum("...i,io->...o")'s kernel gradient built the outer
  # product [i, o, batch, T] (a 30-70x slower split step); a shard's
  # product is one MatMul now, whose gradients are MatMuls too.
  specs = [tf.TensorSpec((BATCH, LENGTH), tf.int32)] * 2
  trainer = mp.TensorParallelTrainer(
      tiny_gpt(), keras.optimizers.SGD(0.1), STRATEGY,
      global_batch_size=BATCH, num_shards=2, devices=["/CPU:0", "/CPU:1"])
  split = tf.function(trainer.gradients).get_concrete_function(*specs)
  model = tiny_gpt()
  unsplit = tf.function(
      lambda x, y: unsplit_gradients(model, x, y, BATCH)
  ).get_concrete_function(*specs)
  assert _largest_tensor(split.graph)[0] <= _largest_tensor(
      unsplit.graph)[0], (_largest_tensor(split.graph),
                          _largest_tensor(unsplit.graph))


def test_a_split_checkpoint_restores_unsplit_and_the_other_way(tmp_path):
  x, _ = token_batches(1)
  x = x[:BATCH]
  unsplit = tiny_gpt()
  expected = unsplit(x).numpy()
  placed = gpt_parallel.split(unsplit, ["/CPU:0", "/CPU:1"])
  for weight in placed.logical_weights():  # a different state to save
    weight.assign(weight.numpy() * 1.5)
  path = tf.train.Checkpoint(model=placed).save(
      str(tmp_path / "split"))
  fresh = tiny_gpt()
  tf.train.Checkpoint(model=fresh).restore(
      path).assert_existing_objects_matched()
  joined = np.concatenate([t.numpy() for t in placed(x)], -1)
  np.testing.assert_allclose(fresh(x).numpy(), joined, rtol=1e-5, atol=1e-6)
  assert np.max(np.abs(fresh(x).numpy() - expected)) > 1e-3
  # And an unsplit checkpoint into a split on the devices the other way
  # round.
  back = tf.train.Checkpoint(model=unsplit).save(str(tmp_path / "unsplit"))
  other = gpt_parallel.split(tiny_gpt(), ["/CPU:1", "/CPU:0"])
  tf.train.Checkpoint(model=other).restore(
      back).assert_existing_objects_matched()
  np.testing.assert_allclose(
      np.concatenate([t.numpy() for t in other(x)], -1), expected,
      rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_blocks_cut_into_stages_equal_unsplit_and_sit_on_their_stage():
  # Tensor 1 x pipeline 2 on the 2 in-process devices: the stage placement
  # (the 8-device test below splits each stage 2 ways too).
  out = compare(STEPS, 1, num_stages=2)
  _check(out)
  placed = out["trainer"].model
  where = lambda v: mp.variable_device(v)
  assert [b.devices for b in placed.blocks] == [("/CPU:0",), ("/CPU:1",)]
  assert {where(v) for v in placed.blocks[1].trainable_variables} == {
      "/CPU:1"}
  assert where(placed.ln_f.gamma) == "/CPU:1"
  assert where(placed.position.positions) == "/CPU:0"


@pytest.mark.parametrize("devices, message", [
    (["/CPU:0", "/CPU:1", "/CPU:0"], "num_shards=3 does not divide "
     "num_heads=4"),
])
def test_a_shard_count_that_does_not_divide_is_one_line(devices, message):
  with pytest.raises(ConfigError, match=message) as error:
    mp.TensorParallelTrainer(tiny_gpt(), keras.optimizers.SGD(0.1), STRATEGY,
                             global_batch_size=BATCH, num_shards=3,
                             devices=devices)
  assert "\n" not in str(error.value)


# The 4- and 8-device splits in one fresh process of 8 devices (a split
# on 4 names its 4 devices): its splits compare against one unsplit run.
_MANY_DEVICES = """
import json
import framework
framework.configure_cpu_devices(8)
from framework import model_parallel as mp
from tests.transformer_split_reference import compare
groups = [["/CPU:0", "/CPU:1"], ["/CPU:2", "/CPU:3"]]
# One GPT block where no stage needs a second (each split traces in a third
# less time; blocks after the first are split alike: test_two_way_split_
# equals_unsplit and the staged splits below run two).
out = {"tensor4": compare(3, 4, num_layers=1), "data2_tensor2": compare(
    3, 2, replica_devices=groups, num_layers=1),
       "tensor2_untied": compare(3, 2, tied=False, num_layers=1)}
groups = [[f"/CPU:{i}" for i in range(4)], [f"/CPU:{i}" for i in range(4, 8)]]
out["tensor2_pipeline2"] = compare(3, 2, num_stages=2)
out["data2_tensor2_pipeline2"] = compare(3, 2, num_stages=2,
                                         replica_devices=groups)
placed = out["tensor2_pipeline2"]["trainer"].model
out["stages"] = [list(b.devices) for b in placed.blocks]
out["block_devices"] = [sorted({mp.variable_device(v)
                                for v in b.trainable_variables})
                        for b in placed.blocks]
copy = out["data2_tensor2_pipeline2"]["trainer"].copies[0][1]
out["copy_stages"] = [list(b.devices) for b in copy.blocks]
for name in ("tensor4", "data2_tensor2", "tensor2_untied",
             "tensor2_pipeline2", "data2_tensor2_pipeline2"):
  out[name].pop("trainer")
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def many_devices():
  return helpers.run_result(_MANY_DEVICES, timeout=1200)


@pytest.mark.slow
def test_four_way_and_data_two_by_tensor_two_equal_unsplit(many_devices):
  out = many_devices
  for name in ("tensor4", "data2_tensor2", "tensor2_untied"):
    _check(out[name])
  assert out["tensor4"]["devices"] == [f"/CPU:{i}" for i in range(4)]
  assert out["data2_tensor2"]["devices"] == ["/CPU:0", "/CPU:1"]


@pytest.mark.slow
def test_tensor_by_pipeline_and_all_three_axes_equal_unsplit(many_devices):
  out = many_devices
  _check(out["tensor2_pipeline2"])
  _check(out["data2_tensor2_pipeline2"])
  # Stage p's blocks are split across its own 2 devices.
  assert out["stages"] == [["/CPU:0", "/CPU:1"], ["/CPU:2", "/CPU:3"]]
  assert out["block_devices"] == out["stages"]
  assert out["copy_stages"] == [["/CPU:4", "/CPU:5"], ["/CPU:6", "/CPU:7"]]
