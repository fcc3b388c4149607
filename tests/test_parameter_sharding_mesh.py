"""Parameter sharding (ZeRO-3) on a mesh's data axis: each of the 2 copies
of a 2-stage pipeline keeps half of its stages' weights, joins each
layer's per call and micro-batch (forward, and again in the backward pass,
which runs the layer again) and trains as ZeRO-2 and unsharded do on the
same mesh (to rounding), with momentum and
AdamW, gradient accumulation, clipping, Dropout and BatchNorm; its
checkpoints resume unsharded, without a split, and the reverse.

The 4-device mesh runs in one fresh process
(`copy_parameter_sharding_reference`), shared by the module's tests.
"""

import math
import re

import numpy as np
import pytest

from framework.app.config import ExperimentConfig
from framework.errors import ConfigError
from framework.model_parallel import ModelParallelConfig
from tests import helpers

TOLERANCE = 1e-5

_MESH = """
import json
import framework
framework.configure_cpu_devices(4)
from tests import copy_parameter_sharding_reference as ref
print("RESULT " + json.dumps(ref.run()))
"""


@pytest.fixture(scope="module")
def mesh():
  return helpers.run_result(_MESH, timeout=1500)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adamw", "momentum"])
def test_zero3_equals_zero2_and_unsharded_on_the_mesh(mesh, optimizer):
  assert mesh["kinds"] == {"plain": "MergeCallUpdate",
                           "zero2": "CopyShardedGradientsUpdate",
                           "zero3": "CopyShardedParametersUpdate"}
  assert mesh["moved"] > 1e-3  # the steps changed the weights
  norms = {mode: mesh["grad_norm"][f"{optimizer}/{mode}"]
           for mode in ("plain", "zero2", "zero3")}
  assert norms["plain"] > 0.05  # above --clip_norm: the clip acted
  assert abs(norms["zero3"] - norms["plain"]) < TOLERANCE * norms["plain"]
  for mode in ("zero2", "zero3"):
    result = mesh[f"{optimizer}/{mode}"]
    assert result["keys"], result  # the unsharded run's checkpoint keys
    assert result["steps"] == 2
    # Each saved tensor's [largest |difference|, largest |value|]: the
    # weights against the largest weight, each slot against itself or a
    # thousandth of the largest slot (one of gradients that are zero but
    # for rounding).
    saved = result["saved"]
    # (The optimizer saves the trainable weights; the model its BatchNorm
    # statistics.)
    weights = [k for k in saved if "_trainable_variables" in k
               or k.startswith("model/")]
    slots = [k for k in saved if k not in weights]
    assert len(weights) == 8 + 2 and len(slots) >= 8, sorted(saved)
    largest = max(saved[k][1] for k in weights)
    for key in weights:
      assert saved[key][0] <= TOLERANCE * largest, (mode, key, saved[key])
    largest = max(saved[k][1] for k in slots)
    for key in slots:
      difference, value = saved[key]
      assert difference <= TOLERANCE * max(value, 1e-3 * largest), (
          mode, key, difference, value)
  # The same sums on the same devices: ZeRO-3 is ZeRO-2 bit for bit.
  # ZeRO-2's up to rounding: each layer runs again in the backward pass
  # (ops of its own, which round differently).
  assert mesh[f"{optimizer}/zero3_vs_zero2"] < TOLERANCE
  # Copy 1's whole weights are released (ZeRO-2's copy keeps them).
  assert mesh[f"{optimizer}/zero3"]["copy_elements"] == 0
  assert mesh[f"{optimizer}/zero2"]["copy_elements"] == sum(
      sum(sizes) for device, sizes in mesh["read"]["plain"].items()) // 2


@pytest.mark.slow
def test_the_step_reads_only_each_copys_half_of_the_weights(mesh):
  read = mesh["read"]
  # Unsharded: each device reads its stage's whole weights; ZeRO-2 its
  # shards too (the slots' weights, set from the whole each step);
  # ZeRO-3 only its shards: half of every weight (rounded up).
  assert sorted(read["plain"]) == ["CPU:0", "CPU:1", "CPU:2", "CPU:3"]
  for device, sizes in read["plain"].items():
    half = [math.ceil(n / 2) for n in sizes]
    assert read["zero2"][device] == sizes + half
    assert read["zero3"][device] == half


@pytest.mark.slow
def test_each_layer_joins_its_weights_forward_and_again_backward(mesh):
  ops = mesh["ops"]
  assert ops["plain"]["gathers"] == ops["zero2"]["gathers"] == 0
  zero3 = ops["zero3"]
  variables = sum(len(sizes) for sizes in mesh["read"]["plain"].values())
  # Every variable of every copy's stages, per accumulation step (2) and
  # micro-batch (2): joined for the forward pass and again for the
  # backward pass; no forward join is kept for the backward pass.
  assert zero3["forward"] == zero3["backward"] == variables * 2 * 2
  assert zero3["kept"] == 0
  # Each layer's joins wait for that layer's inputs (not its stage's): 4
  # layers with weights (Dense; BatchNorm, Dense, Dense) per copy (2),
  # accumulation step (2) and micro-batch (2).
  assert zero3["groups"] == 4 * 2 * 2 * 2


@pytest.mark.slow
def test_a_zero3_checkpoint_resumes_unsharded_and_unsplit_and_back(mesh):
  assert mesh["resumed_moved"] > 1e-3
  assert mesh["zero3_to_plain"] < TOLERANCE
  assert mesh["plain_to_zero3"] < TOLERANCE
  assert mesh["zero3_to_unsplit"] < TOLERANCE


@pytest.mark.slow
def test_a_sequential_models_stages_shard_too(mesh):
  assert mesh["sequential_zero3_vs_zero2"] < TOLERANCE
  assert mesh["sequential_moved"] > 1e-3


_PLACEMENT = """
import collections, json
import framework
framework.configure_cpu_devices(5)
import numpy as np
import tensorflow as tf
from framework.model_parallel.copies import tf_variable
from framework.model_parallel.devices import (_operations, short_device,
                                              variable_device)
from tests import copy_parameter_sharding_reference as ref
from tests import copy_parameter_sharding_tensor_reference as gpt
# The mesh on CPU:1..4: CPU:0 is then the host and no mesh device.
ref.GROUPS = gpt.GROUPS = [["/CPU:1", "/CPU:2"], ["/CPU:3", "/CPU:4"]]

def held(trainer):
  # {device: [whole trainable weights' elements, all elements]}.
  out = collections.defaultdict(lambda: [0, 0])
  models = [trainer.model] + [c[1] for c in trainer.copies]
  trainable = {id(tf_variable(v)) for m in models
               for v in m.trainable_variables}
  state = trainer.copy_sharding
  variables = ([v for m in models for v in m.weights]
               + [s for shards in state.shards for s in shards]
               + state.slot_variables())
  seen = set()
  for v in variables:
    v = tf_variable(v)
    if id(v) in seen:
      continue
    seen.add(id(v))
    n = int(tf.size(v.read_value()))
    entry = out[short_device(v.device)]
    entry[0] += n if id(v) in trainable else 0
    entry[1] += n
  return dict(out)

out = {}
x, _ = next(iter(ref.dataset(1)))
for mode in ("zero2", "zero3"):
  trainer = ref.make_trainer(mode)
  graph = tf.function(trainer.train_step).get_concrete_function(
      (tf.TensorSpec((ref.BATCH, ref.FEATURES), tf.float32),
       tf.TensorSpec((ref.BATCH,), tf.int32))).graph
  trainer.train(iter(ref.dataset(2)), 2)
  out[mode] = {
      "model": sorted({variable_device(v)
                       for v in trainer.model.trainable_variables}),
      "held": held(trainer),
      "ops": dict(collections.Counter(short_device(op.device)
                                      for op in _operations(graph))),
      "logits": trainer.eval_logits(x).numpy().tolist()}
trainer = gpt.make_trainer("data:2,model:2", "zero3")
out["gpt"] = {"model": sorted({variable_device(v)
                               for v in trainer.model.trainable_variables}),
              "held": held(trainer)}
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def placement():
  return helpers.run_result(_PLACEMENT, timeout=1500)


@pytest.mark.slow
def test_no_mesh_device_holds_a_whole_weight_under_zero3(placement):
  mesh = ["/CPU:1", "/CPU:2", "/CPU:3", "/CPU:4"]
  zero2, zero3 = placement["zero2"], placement["zero3"]
  # ZeRO-2: copy 0's whole weights on its stages' devices; ZeRO-3: on the
  # host (CPU:0, no device of the mesh), as a mirrored run's model.
  assert zero2["model"] == ["/CPU:1", "/CPU:2"]
  assert zero3["model"] == ["/CPU:0"]
  whole = sum(zero2["held"][d][0] for d in ("/CPU:1", "/CPU:2"))
  assert whole > 0
  assert zero3["held"]["/CPU:0"][0] == whole
  for device in mesh:
    assert zero3["held"][device][0] == 0, (device, zero3["held"])
    # Each device holds ZeRO-2's share less its whole weights.
    assert zero3["held"][device][1] < zero2["held"][device][1]
  # The step runs nothing on the host: only the mesh's devices (and the
  # function's own unplaced ops).
  assert "/CPU:0" not in zero3["ops"], zero3["ops"]
  assert set(zero3["ops"]) - {""} == set(mesh)
  # Evaluation reads the host copy: ZeRO-2's logits to rounding.
  a, b = np.array(zero3["logits"]), np.array(zero2["logits"])
  assert np.max(np.abs(a - b)) <= TOLERANCE * np.max(np.abs(b))
  gpt = placement["gpt"]
  assert gpt["model"] == ["/CPU:0"]
  assert gpt["held"]["/CPU:0"][0] > 0
  for device in mesh:
    assert gpt["held"][device][0] == 0, (device, gpt["held"])


def _config(mesh="data:2,pipeline:2", model="mlp", **kwargs):
  split = {k: kwargs.pop(k) for k in ("mode", "num_stages", "recompute")
           if k in kwargs}
  return ExperimentConfig(
      model_dir="run", train_steps=1, model=model, dataset="synthetic",
      model_parallel=ModelParallelConfig(mesh=mesh, **split),
      **{"shard_optimizer_state": True, "shard_gradients": True,
         "shard_parameters": True, **kwargs})


def test_a_pipeline_with_a_data_axis_takes_shard_parameters():
  assert _config().shard_parameters
  assert _config(recompute="true").shard_parameters
  assert _config("", mode="pipeline", num_stages=2,
                 strategy="mirrored").shard_parameters


def test_a_gpt_split_with_a_data_axis_takes_shard_parameters():
  # Its own tensor split (data x model), and its pipeline, which is its
  # split cut into stages (data x pipeline).
  assert _config("data:2,model:2", model="gpt").shard_parameters
  assert _config(model="gpt").shard_parameters
  assert _config("data:2,model:2,pipeline:2", model="gpt",
                 recompute="true").shard_parameters


def test_an_unsplit_gpt_under_mirrored_takes_shard_parameters():
  # Its ZeRO-3 is the mirrored replicas' (docs/results/memory.md's rows);
  # only a split of it was refused.
  assert _config("", model="gpt", strategy="mirrored").shard_parameters
  assert _config("", model="gpt",
                 strategy="multi_worker_mirrored").shard_parameters


@pytest.mark.parametrize("kwargs,message", [
    (dict(mesh="data:2,model:2", model="gpt", recompute="attention"),
     "shard_parameters=True with mesh=data:2,model:2 runs each layer's "
     "block again in the backward pass (it joins the block's weights again "
     "there); recompute=attention is not supported with it: use "
     "--recompute=none or true"),
    (dict(recompute="blocks"),
     "shard_parameters=True with mesh=data:2,pipeline:2 runs each layer's "
     "block again in the backward pass (it joins the block's weights again "
     "there); recompute=blocks is not supported with it: use "
     "--recompute=none or true"),
    (dict(check_distribution=True),
     "shard_parameters=True does not support check_distribution=True"),
    (dict(jit_compile=True),
     "shard_parameters=True does not support jit_compile=True"),
])
def test_what_zero3_on_a_mesh_cannot_do_is_one_line(kwargs, message):
  with pytest.raises(ConfigError, match=re.escape(message)) as error:
    _config(**kwargs)
  assert "\n" not in str(error.value)


def test_the_trainers_refuse_a_single_copy():
  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from framework import model_parallel as mp  # pylint: disable=g-import-not-at-top
  from tests import model_parallel_reference as ref  # pylint: disable=g-import-not-at-top
  strategy = tf.distribute.get_strategy()
  sharded = dict(shard_optimizer_state=True, shard_gradients=True,
                 shard_parameters=True, global_batch_size=8)
  model = ref.build("mlp", (7,), 5, seed=6312, hidden_units=(8,))
  with pytest.raises(ConfigError, match="this split has one"):
    mp.PipelineTrainer(model, keras.optimizers.Adam(1e-2), strategy,
                       num_stages=2, devices=["/CPU:0", "/CPU:1"], **sharded)
  # A Dense pair split has no copies: nothing to shard its weights over.
  with pytest.raises(ConfigError, match="this split has one"):
    mp.TensorParallelTrainer(model, keras.optimizers.Adam(1e-2), strategy,
                             num_shards=2, **sharded)
