"""A Dense pair split's folder under the split's own keys (as an older
distloop saved it) whose newest checkpoint is damaged: the run reads the
newest intact one, so its keys decide. On its own split it resumes from
it; on another split it is the one line of such a folder, `--model_dir`
unchanged (not a shape mismatch, not a traceback).
"""

import os
import shutil

import pytest

from tests import helpers

pytestmark = pytest.mark.slow

MLP = ["--model=mlp", "--hidden_units=12", "--dataset=synthetic",
       "--global_batch_size=16", "--steps_per_loop=1", "--checkpoint_every=1",
       "--eval_steps=1", "--noexport_saved_model", "--cpu_devices=2"]
SPLIT = ["--model_parallel=tensor", "--num_shards=2"]


@pytest.fixture(scope="module")
def old_folder(tmp_path_factory):
  """ckpt-1 and ckpt-2 under the split's own keys."""
  model_dir = tmp_path_factory.mktemp("old") / "run"
  proc = helpers.run_python(
      os.path.join(helpers.ROOT, "tests", "old_dense_pair_train.py"), *MLP,
      *SPLIT, "--train_steps=2", f"--model_dir={model_dir}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  return model_dir


def _damaged_copy(old_folder, tmp_path, how):
  model_dir = tmp_path / "run"
  shutil.copytree(old_folder, model_dir)
  if how == "index":
    os.remove(model_dir / "ckpt-2.index")
  else:  # a data file shorter than its index says
    with open(model_dir / "ckpt-2.data-00000-of-00001", "r+b") as f:
      f.truncate(100)
  return model_dir


@pytest.mark.parametrize("how", ["index", "data"])
def test_its_own_split_resumes_from_the_older_intact_one(old_folder, tmp_path,
                                                         how):
  model_dir = _damaged_copy(old_folder, tmp_path, how)
  proc = helpers.run_script("train.py", *MLP, *SPLIT, "--train_steps=3",
                            f"--model_dir={model_dir}")
  assert "ckpt-1 as a Dense pair split's own keys" in proc.stderr


@pytest.mark.parametrize("how", ["index", "data"])
def test_another_split_is_the_one_line(old_folder, tmp_path, how):
  model_dir = _damaged_copy(old_folder, tmp_path, how)
  before = helpers.snapshot(str(model_dir))
  proc = helpers.run_script("train.py", *MLP, "--train_steps=3",
                            f"--model_dir={model_dir}", check=False)
  helpers.assert_one_line_error(
      proc, "train.py", "resuming on another model split is not supported",
      "resume with model_parallel=tensor num_shards=2 once", unchanged=before)
