"""Parameter sharding (ZeRO-3) over the copies of a tensor split: the GPT
on `data:2,model:2` and on its own pipeline `data:2,pipeline:2`; each
copy keeps half of every weight of its device positions, each placed
block joins the weights it reads on its device, forward and again
backward, and the copies train as ZeRO-2 and unsharded do on the same
mesh (to rounding), with Adam and AdamW, gradient accumulation and
clipping;
its checkpoints resume unsharded, without a split, and the reverse; a
run killed with kill -9 and relaunched ends as an uninterrupted one.

The 4-device meshes run in one fresh process
(`copy_parameter_sharding_tensor_reference`), shared by the module's
tests; the kill -9 test runs train.py.
"""

import math
import os
import subprocess
import sys

import pytest

from tests import cluster_utils
from tests import helpers

TOLERANCE = 1e-5

_MESH = """
import json
import framework
framework.configure_cpu_devices(4)
from tests import copy_parameter_sharding_tensor_reference as ref
print("RESULT " + json.dumps(ref.run()))
"""

CASES = ["data:2,model:2/adam", "data:2,pipeline:2/adamw"]


@pytest.fixture(scope="module")
def mesh():
  return helpers.run_result(_MESH, timeout=1500)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_zero3_equals_zero2_and_unsharded_on_a_tensor_mesh(mesh, case):
  result = mesh[case]
  assert result["kinds"]["zero3"] == "CopyShardedParametersUpdate"
  assert result["moved"] > 5e-4  # the steps changed the weights
  norms = result["grad_norm"]
  assert norms["plain"] > 0.05  # above the clip norm: the clip acted
  assert abs(norms["zero3"] - norms["plain"]) < TOLERANCE * norms["plain"]
  zero3 = result["zero3"]
  assert zero3["keys"]  # the unsharded run's checkpoint keys
  assert zero3["steps"] == 2
  # Copy 1's whole weights are released: its devices hold only shards.
  assert zero3["copy_elements"] == 0
  if "zero2" in result:  # ZeRO-2's copy keeps them
    assert result["zero2"]["copy_elements"] == sum(
        sum(n) for n in result["whole"].values()) // 2
  # Each saved tensor's [largest |difference|, largest |value|]: the
  # weights against the largest weight, each slot against itself or a
  # thousandth of the largest slot (one of gradients that are zero but
  # for rounding).
  saved = zero3["saved"]
  weights = [k for k in saved if "_trainable_variables" in k
             or k.startswith("model/")]
  slots = [k for k in saved if k not in weights]
  # The unsplit GPT's 36 weights (saved once, under the optimizer's keys).
  assert len(weights) == 36 and len(slots) >= 36, sorted(saved)
  largest_weight = max(saved[k][1] for k in weights)
  for key in weights:
    assert saved[key][0] <= TOLERANCE * largest_weight, (key, saved[key])
  largest = max(saved[k][1] for k in slots)
  for key in slots:
    difference, value = saved[key]
    assert difference <= TOLERANCE * max(value, 1e-3 * largest), (
        key, difference, value)
  if case == "data:2,model:2/adam":
    # ZeRO-2's up to rounding: each placed block runs again in the
    # backward pass (ops of its own, which round differently).
    assert result["zero3_vs_zero2"] < TOLERANCE * largest_weight


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_each_device_reads_only_shards(mesh, case):
  result = mesh[case]
  whole = result["whole"]
  assert sorted(result["read"]["zero3"]) == sorted(whole)
  for device, sizes in whole.items():
    # Only its shards (no whole weight of any copy): half of each of the
    # weights that live there, rounded up.
    half = [math.ceil(n / 2) for n in sizes]
    assert sorted(result["read"]["zero3"][device]) == sorted(half), (
        case, device)


@pytest.mark.slow
@pytest.mark.parametrize("case,positions", [(CASES[0], 2), (CASES[1], 1)])
def test_each_block_joins_what_it_reads_forward_and_again_backward(
    mesh, case, positions):
  joins = mesh[case]["joins"]["zero3"]
  # Every placed block joins the weights it reads when its inputs exist,
  # and again in its backward pass; no forward join is kept for it.
  assert joins["forward"] == joins["backward"] >= (
      mesh[case]["variables"] * 2 * 2)  # every weight, 2 copies x 2 passes
  assert joins["kept"] == 0
  # One set of tensors waited for per block, not per split: per copy (2)
  # and accumulation pass (2), on each of the split's device positions
  # the position embedding and, per transformer block (2), 4 blocks (a
  # norm and shard, a residual add, twice), plus the head, and one set
  # for the lookups (no inputs of their own: they wait for the batch).
  assert joins["groups"] == 2 * 2 * (positions * (1 + 4 * 2 + 1) + 1)


@pytest.mark.slow
def test_a_tensor_mesh_zero3_checkpoint_resumes_unsharded_and_back(mesh):
  assert mesh["resumed_moved"] > 1e-3
  assert mesh["zero3_to_plain"] < TOLERANCE
  assert mesh["plain_to_zero3"] < TOLERANCE
  assert mesh["zero3_to_unsplit"] < TOLERANCE
  assert mesh["unsplit_vs_mesh"] < TOLERANCE


GPT_MESH = ["--model=gpt", "--dataset=text", "--cpu_devices=4",
            "--mesh=data:2,model:2", "--shard_optimizer_state",
            "--shard_gradients", "--shard_parameters", "--seed=6332",
            "--global_batch_size=8", "--sequence_length=16",
            "--model_width=16", "--num_heads=2", "--num_layers=1",
            "--steps_per_loop=1", "--checkpoint_every=2", "--log_every=1",
            "--summary_every=0", "--eval_steps=1"]


@pytest.mark.slow
def test_kill_9_and_relaunch_equals_uninterrupted(tmp_path):
  steps = 6
  reference = str(tmp_path / "reference")
  proc = cluster_utils.run_train(
      GPT_MESH + [f"--model_dir={reference}", f"--train_steps={steps}"],
      timeout=900)
  assert proc.returncode == 0, proc.stderr[-4000:]
  model_dir = str(tmp_path / "run")
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
  with open(tmp_path / "killed.log", "wb") as log:
    process = subprocess.Popen(
        [sys.executable, os.path.join(helpers.ROOT, "scripts", "train.py"),
         *GPT_MESH, f"--model_dir={model_dir}", "--train_steps=100000"],
        cwd=helpers.ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
  try:
    cluster_utils.wait_for_checkpoint(model_dir, 2, [process], timeout=900)
  finally:
    process.kill()  # SIGKILL
    process.wait()
  assert 0 < cluster_utils.checkpoint_step(model_dir) < steps
  relaunch = cluster_utils.run_train(
      GPT_MESH + [f"--model_dir={model_dir}", f"--train_steps={steps}"],
      timeout=900)
  assert relaunch.returncode == 0, relaunch.stderr[-4000:]
  assert "Restored checkpoint" in relaunch.stderr + relaunch.stdout
  assert cluster_utils.global_step(model_dir) == steps
  assert cluster_utils.max_weight_difference(reference, model_dir) == 0.0
