"""A Dense pair tensor split (`--model=mlp --model_parallel=tensor`)
checkpoints the unsplit model's keys, the cut weights whole: a run goes on
unsplit, on another `--num_shards`, or from unsplit to split, as one
continuous unsplit run would (every checkpoint tensor within 1e-6). A
folder saved under the split's own keys (tests/old_dense_pair_train.py
writes one as distloop did) resumes on its split, and then on any; on
another split it is one line, and a foreign checkpoint is one line too,
`--model_dir` unchanged.
"""

import os
import shutil

import numpy as np
import pytest
import tensorflow as tf

from tests import helpers

pytestmark = pytest.mark.slow

MLP = ["--model=mlp", "--hidden_units=12", "--dataset=synthetic",
       "--global_batch_size=32", "--steps_per_loop=2", "--eval_steps=1",
       "--noexport_saved_model", "--cpu_devices=4"]
K = 2  # steps before the relaunch; 2K in all
TOLERANCE = 1e-6


def _split(shards):
  return ([f"--model_parallel=tensor", f"--num_shards={shards}"]
          if shards else [])


def _train(model_dir, steps, shards, script="train.py", check=True):
  args = [*MLP, f"--model_dir={model_dir}", f"--train_steps={steps}",
          *_split(shards)]
  if script == "train.py":
    return helpers.run_script(script, *args, check=check)
  proc = helpers.run_python(os.path.join(helpers.ROOT, "tests", script),
                            *args)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc


def _tensors(model_dir):
  """{key: array} of the latest checkpoint (its object graph left out, and
  `save_counter`: a relaunch saves once more)."""
  reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(model_dir))
  return {key: reader.get_tensor(key)
          for key in reader.get_variable_to_shape_map()
          if not key.startswith(("_CHECKPOINTABLE", "save_counter"))}


def _assert_continuous(model_dir, reference):
  got, want = _tensors(model_dir), _tensors(reference)
  assert sorted(got) == sorted(want)  # the unsplit run's keys and shapes
  worst = {key: float(np.max(np.abs(np.asarray(got[key], np.float64) -
                                    np.asarray(want[key], np.float64))))
           for key in want}
  assert max(worst.values()) < TOLERANCE, worst


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """The model_dir of 2K unsplit steps."""
  model_dir = tmp_path_factory.mktemp("unsplit") / "run"
  _train(model_dir, 2 * K, None)
  return model_dir


@pytest.mark.parametrize("first, then", [(2, None), (None, 2), (2, 4)])
def test_a_split_resumes_on_another_as_one_unsplit_run(tmp_path, reference,
                                                       first, then):
  model_dir = tmp_path / "run"
  _train(model_dir, K, first)
  proc = _train(model_dir, 2 * K, then)
  assert "model split changed" in proc.stderr
  _assert_continuous(model_dir, reference)


def test_a_folder_of_the_splits_own_keys_resumes_on_it_then_on_any(
    tmp_path, reference):
  model_dir = tmp_path / "old"
  _train(model_dir, K // 2, 2, script="old_dense_pair_train.py")
  reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(model_dir))
  assert reader.get_variable_to_shape_map()[
      "optimizer/_trainable_variables/0/.ATTRIBUTES/VARIABLE_VALUE"] == [
          3072, 6]  # a shard: the split's own keys
  # Another split first: one line, nothing touched.
  before = helpers.snapshot(str(model_dir))
  proc = _train(model_dir, 2 * K, 4, check=False)
  helpers.assert_one_line_error(
      proc, "train.py", "resuming on another model split is not supported",
      "resume with model_parallel=tensor num_shards=2 once",
      unchanged=before)
  # Its own split reads it; its next checkpoint is the unsplit model's,
  # which resumes unsplit.
  _train(model_dir, K, 2)
  proc = _train(model_dir, 2 * K, None)
  assert "model split changed" in proc.stderr
  _assert_continuous(model_dir, reference)


def test_a_foreign_checkpoint_is_one_line(tmp_path):
  model_dir = tmp_path / "run"
  helpers.run_script("train.py", "--model=cifar_cnn", "--dataset=synthetic",
                     "--global_batch_size=8", "--train_steps=1",
                     "--eval_steps=1", "--noexport_saved_model",
                     f"--model_dir={model_dir}")
  shutil.copy(os.path.join(model_dir, "model_info.json"),
              tmp_path / "model_info.json")
  before = helpers.snapshot(str(model_dir))
  proc = _train(model_dir, 2, 2, check=False)
  assert proc.returncode != 0
  helpers.assert_one_line_error(proc, "train.py", "", unchanged=before)


def test_a_warm_start_puts_every_weight_into_the_split(tmp_path):
  # The cut weights (whole-tensor views, not variables) were skipped: the
  # pair kept its fresh values and "Warm start: 3 variables" said nothing.
  source = tmp_path / "source"
  _train(source, K, 0)
  runs = {}
  for shards in (0, 2):
    model_dir = tmp_path / f"warm{shards}"
    proc = helpers.run_script(
        "train.py", *MLP, f"--model_dir={model_dir}", f"--train_steps={K}",
        f"--init_checkpoint={source}", *_split(shards))
    assert "Warm start: 4 variables" in proc.stderr, proc.stderr[-3000:]
    runs[shards] = model_dir
  got, want = _tensors(runs[2]), _tensors(runs[0])
  for key in want:
    if key.startswith("model/"):
      np.testing.assert_allclose(got[key], want[key], atol=TOLERANCE, rtol=0)
