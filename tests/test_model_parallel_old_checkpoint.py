"""A gpt split's checkpoint written before cross-mesh resume (its optimizer
under the split optimizer's own keys and shapes, the split model's
fingerprint: tests/old_split_train.py writes one as that distloop did)
resumes on the same mesh exactly as one continuous run (weights and Adam's
slots within 1e-5), and its next checkpoint is in the unsplit layout; on
another split it is refused in one line, --model_dir unchanged. A restore
of an older layout must consume every value the checkpoint holds.
"""

import os
import shutil

import numpy as np
import pytest
import tensorflow as tf

from framework.core.checkpoints.manager import CheckpointManager
from framework.errors import CheckpointError
from tests import helpers

GPT = ["--model=gpt", "--dataset=text", "--global_batch_size=8",
       "--sequence_length=16", "--model_width=32", "--num_heads=4",
       "--num_layers=2", "--steps_per_loop=2", "--eval_steps=1",
       "--noexport_saved_model"]
MESH = ["--mesh=data:2,model:2", "--cpu_devices=4"]
K = 2  # steps the older version trained; 2K in all
TOLERANCE = 1e-5


def _train(model_dir, steps, *flags, script="train.py", check=True):
  args = [*GPT, f"--model_dir={model_dir}", f"--train_steps={steps}", *flags]
  if script == "train.py":
    return helpers.run_script(script, *args, timeout=900, check=check)
  proc = helpers.run_python(os.path.join(helpers.ROOT, "tests", script),
                            *args, timeout=900)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc


def _tensors(model_dir):
  """{key: array} of the latest checkpoint's float values."""
  reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(model_dir))
  out = {}
  for key in reader.get_variable_to_shape_map():
    value = reader.get_tensor(key)
    if isinstance(value, np.ndarray) and value.dtype.kind == "f":
      out[key] = value.astype(np.float64)
  return out


@pytest.fixture(scope="module")
def old_run(tmp_path_factory):
  """model_dir of K steps on MESH, saved as distloop before cross-mesh
  resume saved it."""
  model_dir = tmp_path_factory.mktemp("old") / "run"
  _train(model_dir, K, *MESH, script="old_split_train.py")
  return model_dir


@pytest.mark.slow
def test_the_same_mesh_resumes_an_older_checkpoint_as_one_continuous_run(
    tmp_path, old_run):
  reference = tmp_path / "continuous"
  want_loss = helpers.final_eval(
      _train(reference, 2 * K, *MESH).stderr)["loss"]
  model_dir = tmp_path / "resumed"
  shutil.copytree(old_run, model_dir)
  proc = _train(model_dir, 2 * K, *MESH)
  lines = [l for l in proc.stderr.splitlines() if "predates" in l]
  assert len(lines) == 1, proc.stderr[-3000:]
  assert "restoring it as this split's" in lines[0]
  got, want = _tensors(model_dir), _tensors(reference)
  assert sorted(got) == sorted(want)  # the unsplit layout from now on
  weights = max(float(np.max(np.abs(got[k] - want[k])) /
                      max(float(np.max(np.abs(want[k]))), 1e-12))
                for k in want)
  loss = abs(helpers.final_eval(proc.stderr)["loss"] - want_loss) / want_loss
  print("max relative differences:", {"weights and slots": weights,
                                      "loss": loss})  # shown with -s
  assert max(weights, loss) < TOLERANCE


@pytest.mark.slow
def test_another_split_refuses_an_older_checkpoint_in_one_line(
    tmp_path, old_run):
  model_dir = tmp_path / "run"
  shutil.copytree(old_run, model_dir)
  before = helpers.snapshot(str(model_dir))
  proc = _train(model_dir, 2 * K, check=False)  # unsplit
  helpers.assert_one_line_error(
      proc, "train.py", "predates resuming on another mesh",
      "its own split (mesh=data:2,model:2), which this split (none) cannot "
      "read", 
      "resume it with mesh=data:2,model:2 first", unchanged=before)


def test_an_older_layout_restore_consumes_every_saved_value(tmp_path):
  a, b = tf.Variable([1.0, 2.0]), tf.Variable(3.0)
  tf.train.Checkpoint(a=a, b=b).save(str(tmp_path / "ckpt"))
  a.assign([0.0, 0.0])
  manager = CheckpointManager(tf.train.Checkpoint(a=a), str(tmp_path),
                              tf.distribute.get_strategy())
  with manager.restoring_older():
    with pytest.raises(CheckpointError, match="does not match"):
      manager.restore_latest()
  assert manager.restore_latest()  # the usual restore: a's value only
  np.testing.assert_array_equal(a.numpy(), [1.0, 2.0])
