"""Gradient sharding (ZeRO-2) on a mesh's data axis: each of the 2 copies
of a split receives, accumulates and updates with only its half of each
summed gradient, and trains as ZeRO-1 and unsharded do on the same mesh,
with gradient accumulation and clipping; its checkpoints resume unsharded
and without a split.

The 4-device meshes run in one fresh process
(`copy_gradient_sharding_reference`), shared by the module's tests.
"""

import math
import re

import keras
import numpy as np
import pytest

from framework.app.config import ExperimentConfig
from framework.errors import ConfigError
from framework.model_parallel import ModelParallelConfig
from tests import helpers

TOLERANCE = 1e-6
SPLIT_TOLERANCE = 1e-5
STEPS = {"data:2,model:2": 2, "data:2,pipeline:2": 3}
MESHES = list(STEPS)

_MESHES = """
import json
import framework
framework.configure_cpu_devices(4)
from tests import copy_gradient_sharding_reference as ref
out = {mesh: ref.run(mesh, steps) for mesh, steps in %r.items()}
print("RESULT " + json.dumps(out))
""" % STEPS


@pytest.fixture(scope="module")
def meshes():
  return helpers.run_result(_MESHES, timeout=1500)


@pytest.mark.slow
@pytest.mark.parametrize("mesh", MESHES)
def test_zero2_equals_zero1_and_unsharded_on_the_mesh(meshes, mesh):
  out = meshes[mesh]
  assert out["kinds"] == {"plain": "MergeCallUpdate",
                          "zero1": "CopyShardedUpdate",
                          "zero2": "CopyShardedGradientsUpdate"}
  assert out["moved"] > 1e-3, out  # the steps changed the weights
  norms = out["grad_norm"]
  assert norms["plain"] > 0.05  # above --clip_norm: the clip acted
  assert abs(norms["zero2"] - norms["plain"]) < TOLERANCE * norms["plain"]
  for mode in ("zero1", "zero2"):
    result = out[mode]
    print(f"{mesh} {mode}: max relative weight difference "
          f"{result['weights']:.3g}")
    assert result["weights"] < TOLERANCE, result
    assert result["copies"] < TOLERANCE, result
    assert result["steps"] == STEPS[mesh]
    # The checkpoint holds the full slots under the unsharded run's keys.
    assert result["slot_keys"] > 4, result
    slots = result["slots"]
    largest = max(value for _, value in slots.values())
    for key, (difference, value) in slots.items():
      # Slots of gradients that are zero but for rounding (an attention
      # key bias's) are compared at a thousandth of the largest slot.
      assert difference <= TOLERANCE * max(value, 1e-3 * largest), (
          key, difference, value)


@pytest.mark.slow
@pytest.mark.parametrize("mesh", MESHES)
def test_zero2_receives_and_accumulates_half_without_an_all_reduce(
    meshes, mesh):
  out = meshes[mesh]
  sizes = out["variable_elements"]
  # What the update receives: both copies' gradients, copy 0's first.
  assert out["received"]["zero1"] == [sizes * 2]
  assert out["received"]["zero2"] == [[math.ceil(n / 2) for n in sizes] * 2]
  ops = out["ops"]
  # Stages (pipeline) or device positions (tensor): 2 groups, each
  # reduced over 2 copies. ZeRO-1 all-reduces each group's accumulated
  # gradient once per copy; ZeRO-2 sums slices (one AddN per group, copy
  # and accumulation step), with no gradient all-reduce.
  assert ops["zero1"]["collective_reduce"] - ops["zero2"][
      "collective_reduce"] == 2 * 2
  assert ops["zero1"]["slice_sums"] == 0
  assert ops["zero2"]["slice_sums"] == 2 * 2 * 2
  if mesh == "data:2,pipeline:2":  # no all-reduce inside a copy
    assert ops["zero2"]["collective_reduce"] == 0
  # The accumulator (grad_accum_steps=2: one sum per variable and copy)
  # holds half the gradient.
  assert ops["zero1"]["accumulate_elements"] == 2 * sum(sizes)
  assert ops["zero2"]["accumulate_elements"] == 2 * sum(
      math.ceil(n / 2) for n in sizes)
  assert ops["plain"] == ops["zero1"]


@pytest.mark.slow
@pytest.mark.parametrize("mesh", MESHES)
def test_a_zero2_checkpoint_resumes_unsharded_and_unsplit(meshes, mesh):
  out = meshes[mesh]
  steps = 2 * STEPS[mesh]
  assert out["zero2_to_plain"]["steps"] == steps
  assert out["zero2_to_plain"]["weights"] < TOLERANCE, out["zero2_to_plain"]
  assert out["zero2_to_plain"]["copies"] < TOLERANCE
  # On one device the sums run in another order than on the split.
  assert out["zero2_to_unsplit"]["steps"] == steps
  assert out["zero2_to_unsplit"]["weights"] < SPLIT_TOLERANCE, (
      out["zero2_to_unsplit"])


def _config(mesh="data:2,model:2", **kwargs):
  split = {k: kwargs.pop(k) for k in ("mode", "num_stages") if k in kwargs}
  return ExperimentConfig(
      model_dir="run", train_steps=1, model="gpt", dataset="text",
      model_parallel=ModelParallelConfig(mesh=mesh, **split),
      **{"shard_optimizer_state": True, "shard_gradients": True, **kwargs})


def test_a_mesh_with_a_data_axis_takes_shard_gradients():
  for mesh in ("data:2,model:2", "data:2,pipeline:2",
               "data:2,model:2,pipeline:2"):
    assert _config(mesh).shard_gradients
  config = _config("", mode="pipeline", num_stages=2, strategy="mirrored")
  assert config.shard_gradients


@pytest.mark.parametrize("kwargs,message", [
    (dict(shard_optimizer_state=False),
     "shard_gradients=True needs shard_optimizer_state=True (it shards the "
     "gradients of the sharded optimizer update, ZeRO-2 over ZeRO-1); add "
     "shard_optimizer_state or turn shard_gradients off"),
    (dict(shard_parameters=True, jit_compile=True),
     "shard_parameters=True does not support jit_compile=True"),
])
def test_what_a_mesh_cannot_shard_is_one_line(kwargs, message):
  with pytest.raises(ConfigError, match=re.escape(message)) as error:
    _config(**kwargs)
  assert "\n" not in str(error.value)


def test_accumulation_on_a_split_equals_the_unsplit_accumulation():
  # One copy of a 2-stage pipeline (the conftest's 2 devices): K whole
  # pipeline passes, each gradient summed on its stage's device.
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from framework import model_parallel as mp  # pylint: disable=g-import-not-at-top
  from framework.core.trainer import Trainer  # pylint: disable=g-import-not-at-top
  from tests import model_parallel_reference as ref  # pylint: disable=g-import-not-at-top
  strategy = tf.distribute.get_strategy()
  x, y = ref.data(12, (7,), 5, seed=6303)

  def trained(split):
    model = ref.build("mlp", (7,), 5, seed=6303, hidden_units=(9,))
    kwargs = dict(global_batch_size=12, grad_accum_steps=3, clip_norm=0.1)
    trainer = (mp.PipelineTrainer(model, keras.optimizers.Adam(1e-2),
                                  strategy, num_stages=2,
                                  devices=["/CPU:0", "/CPU:1"],
                                  num_microbatches=2, **kwargs)
               if split else Trainer(model, keras.optimizers.Adam(1e-2),
                                     strategy, **kwargs))
    trainer.train(ref.batches(x, y), 3)
    return np.concatenate([np.ravel(w.numpy())
                           for w in trainer.model.trainable_weights])

  unsplit, split = trained(False), trained(True)
  start = np.concatenate([np.ravel(w) for w in ref.build(
      "mlp", (7,), 5, seed=6303, hidden_units=(9,)).get_weights()])
  assert np.max(np.abs(unsplit - start)) > 1e-3
  assert np.max(np.abs(split - unsplit)) < SPLIT_TOLERANCE * np.max(
      np.abs(unsplit))
