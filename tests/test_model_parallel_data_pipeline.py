"""Data x pipeline: R = 2 copies of a 2-stage pipeline on 4 CPU devices.

In-process tests have 2 logical CPU devices (conftest), so the 4-device runs
happen in subprocesses (the two in-process comparisons in one, shared).
"""

import os

import pytest

from framework.errors import ConfigError
from framework.model_parallel import copies
from tests import helpers

STEPS = 4

# Trains the unsplit MLP on one device and the 2 x 2 data x pipeline on the
# same global batches, one step at a time; prints what the test checks.
_COMPARE = """
import json, sys
import numpy as np
import tensorflow as tf
import framework
framework.configure_cpu_devices(4)
import keras
from framework import model_parallel as mp
from tests.model_parallel_reference import STRATEGY, build, data, skip_model

BATCH, STEPS = 16, int(sys.argv[1])


def compare(kind):
  make = {"mlp": lambda: build("mlp", (12,), 5, hidden_units=(16, 16)),
          "skip": lambda: skip_model(12, 5, units=16)}[kind]
  x, y = data(BATCH * STEPS, (12,), 5)
  reference = framework.Trainer(make(), keras.optimizers.Adam(1e-2), STRATEGY,
                                global_batch_size=BATCH)
  pipeline = mp.PipelineTrainer(
      make(), keras.optimizers.Adam(1e-2), STRATEGY, global_batch_size=BATCH,
      num_stages=2, num_microbatches=2,
      **({"stage_boundaries": ("c",)} if kind == "skip" else {}),
      replica_devices=[["/CPU:0", "/CPU:1"], ["/CPU:2", "/CPU:3"]])
  batches = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
  ref_it, mp_it = iter(batches), iter(batches)
  (copy_stages, copy_model, _), = pipeline.copies
  out = {"weights": [], "loss": [], "copies": [], "devices": []}
  for step in range(STEPS):
    ref_loss = float(reference.train(ref_it, 1)["loss"])
    mp_loss = float(pipeline.train(mp_it, 1)["loss"])
    out["loss"].append(abs(ref_loss - mp_loss))
    out["weights"].append(max(
        float(np.max(np.abs(a.numpy() - b.numpy())))
        for a, b in zip(pipeline.model.weights, reference.model.weights)))
    # Read before the next train() call re-syncs the copies.
    out["copies"].append(max(
        float(np.max(np.abs(a.numpy() - b.numpy())))
        for a, b in zip(pipeline.model.weights, copy_model.weights)))
  out["devices"] = [[mp.variable_device(v) for v in s.trainable_variables]
                    for s in pipeline.stages + copy_stages]
  out["moved"] = float(np.max(np.abs(
      pipeline.model.weights[0].numpy() - make().weights[0].numpy())))
  out["names"] = [s.name for s in pipeline.stages + copy_stages]
  graph = tf.function(pipeline.gradients).get_concrete_function(
      tf.TensorSpec((BATCH, 12), tf.float32),
      tf.TensorSpec((BATCH,), tf.int32)).graph
  out["collectives"] = sorted(
      op.device.split("device:")[-1] for op in graph.get_operations()
      if op.type == "CollectiveReduceV2")
  return out


print("RESULT " + json.dumps({kind: compare(kind) for kind in sys.argv[2:]}))
"""


@pytest.fixture(scope="module")
def compared():
  """{kind: what the test checks}, both kinds in one 4-device process."""
  return helpers.run_result(_COMPARE, str(STEPS), "mlp", "skip", timeout=600)


@pytest.mark.parametrize("kind", ["mlp", "skip"])
def test_two_by_two_equals_single_device_training(compared, kind):
  result = compared[kind]
  assert result["moved"] > 1e-3  # the weights did train
  # Copy 0 (the model) equals the unsplit model after every step ...
  assert max(result["weights"]) < 1e-5, result["weights"]
  assert max(result["loss"]) < 1e-5, result["loss"]
  # ... and copy 1 applied the same all-reduced update: identical weights.
  assert result["copies"] == [0.0] * STEPS, result["copies"]
  # Stage i of copy r lives on device r * 2 + i.
  if kind == "mlp":
    assert result["devices"] == [["/CPU:0"] * 2, ["/CPU:1"] * 4,
                                 ["/CPU:2"] * 2, ["/CPU:3"] * 4]
  else:  # a, b | c, out (the skip from a crosses the cut)
    assert result["devices"] == [["/CPU:0"] * 4, ["/CPU:1"] * 4,
                                 ["/CPU:2"] * 4, ["/CPU:3"] * 4]
  assert result["names"] == ["stage_0", "stage_1", "copy_1_stage_0",
                             "copy_1_stage_1"]
  # Each stage's gradients: one TensorFlow collective per copy, on its
  # device (stage 0 over CPU:0 and CPU:2, stage 1 over CPU:1 and CPU:3).
  assert result["collectives"] == ["CPU:0", "CPU:1", "CPU:2", "CPU:3"], (
      result["collectives"])


def test_replica_groups_cut_consecutive_devices():
  assert copies.replica_groups(
      [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(6)],
      3) == [["/CPU:0", "/CPU:1", "/CPU:2"], ["/CPU:3", "/CPU:4", "/CPU:5"]]
  with pytest.raises(ConfigError, match=r"3 devices.*num_stages=2"):
    copies.replica_groups(["/CPU:0", "/CPU:1", "/CPU:2"], 2)


_FLAGS = ["--model=mlp", "--hidden_units=16", "--dataset=synthetic",
          "--strategy=mirrored", "--model_parallel=pipeline",
          "--num_stages=2", "--num_microbatches=2", "--global_batch_size=16",
          "--train_steps=4", "--steps_per_loop=2", "--eval_every=4"]


def test_train_py_data_x_pipeline_end_to_end(tmp_path):
  model_dir = tmp_path / "run"
  proc = helpers.run_script("train.py", *_FLAGS, "--cpu_devices=4",
                            f"--model_dir={model_dir}", timeout=600)
  names = set(os.listdir(model_dir))
  assert {"model.weights.h5", "model_info.json", "checkpoint"} <= names, names
  assert "2 copies of a 2-stage pipeline" in proc.stderr


def test_train_py_device_count_not_a_multiple_is_one_line(tmp_path):
  model_dir = tmp_path / "bad"
  before = helpers.snapshot(model_dir)
  proc = helpers.run_script("train.py", *_FLAGS, "--cpu_devices=3",
                            f"--model_dir={model_dir}", check=False)
  helpers.assert_one_line_error(
      proc, "train.py", "strategy=mirrored has 3 devices, not a multiple of "
      "num_stages=2", unchanged=before)


def test_train_py_unet_data_x_pipeline_end_to_end(tmp_path):
  # A functional model with skips: 2 copies of a 2-stage graph cut.
  model_dir = tmp_path / "unet"
  proc = helpers.run_script(
      "train.py", "--model=unet", "--dataset=shapes", "--unet_depth=2",
      "--unet_width=4", "--image_size=16", "--strategy=mirrored",
      "--cpu_devices=4", "--model_parallel=pipeline", "--num_stages=2",
      "--num_microbatches=2", "--global_batch_size=8", "--train_steps=2",
      "--steps_per_loop=2", "--noexport_saved_model",
      f"--model_dir={model_dir}", timeout=600)
  assert "2 copies of a 2-stage pipeline" in proc.stderr
  assert "final eval" in proc.stderr and "mean_iou" in proc.stderr
  assert (model_dir / "model.weights.h5").exists()
