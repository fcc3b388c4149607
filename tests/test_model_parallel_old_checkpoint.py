"""A gpt split's checkpoint written before cross-mesh resume (its optimizer
under the split optimizer's own keys and shapes, the split model's
fingerprint: tests/old_split_train.py writes one as that distloop did) is
refused by train.py in one line naming scripts/migrate_split_checkpoint.py,
--model_dir unchanged; migrated by that script (with the run's flags), it
resumes on the same mesh exactly as one continuous run (weights and Adam's
slots within 1e-5), in the unsplit layout, also when a first migration was
killed half-way through its save. The script refuses another
split's flags, a damaged checkpoint (naming the file) and a missing
--model_dir in one line.
"""

import os
import shutil

import numpy as np
import pytest
import tensorflow as tf

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
  if script != "old_split_train.py":
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
def test_a_migrated_checkpoint_resumes_as_one_continuous_run(
    tmp_path, old_run):
  reference = tmp_path / "continuous"
  want_loss = helpers.final_eval(
      _train(reference, 2 * K, *MESH).stderr)["loss"]
  model_dir = tmp_path / "resumed"
  shutil.copytree(old_run, model_dir)
  proc = _train(model_dir, 2 * K, *MESH, script="migrate_split_checkpoint.py")
  lines = [l for l in proc.stderr.splitlines() if "migrated checkpoint" in l]
  assert len(lines) == 1, proc.stderr[-3000:]
  assert "resumes on any mesh" in lines[0]
  # Killed half-way through a save, as a run again would find it: the new
  # checkpoint (same name) half-written, the run's records still the old
  # ones. Run again, the script migrates the copy it kept.
  assert os.listdir(model_dir / "before_migration")
  for name in ("run_config.json", "model_info.json"):
    shutil.copy(old_run / name, model_dir / name)
  data, = [p for p in os.listdir(model_dir) if p.startswith(f"ckpt-{K}.data")]
  os.truncate(model_dir / data, 1000)
  _train(model_dir, 2 * K, *MESH, script="migrate_split_checkpoint.py")
  proc = _train(model_dir, 2 * K, *MESH)
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
@pytest.mark.parametrize("flags", [MESH, []], ids=["same_mesh", "unsplit"])
def test_train_refuses_an_older_checkpoint_in_one_line_naming_the_script(
    tmp_path, old_run, flags):
  model_dir = tmp_path / "run"
  shutil.copytree(old_run, model_dir)
  before = helpers.snapshot(str(model_dir))
  proc = _train(model_dir, 2 * K, *flags, check=False)
  helpers.assert_one_line_error(
      proc, "train.py", "saved before cross-mesh resume",
      "its own split, mesh=data:2,model:2",
      "python scripts/migrate_split_checkpoint.py", unchanged=before)


@pytest.mark.slow
def test_the_script_refuses_another_split_in_one_line(tmp_path, old_run):
  model_dir = tmp_path / "run"
  shutil.copytree(old_run, model_dir)
  before = helpers.snapshot(str(model_dir))
  proc = _train(model_dir, 2 * K, script="migrate_split_checkpoint.py",
                check=False)  # unsplit
  helpers.assert_one_line_error(
      proc, "migrate_split_checkpoint.py",
      "was saved by split mesh=data:2,model:2",
      "flags of the run that wrote it", unchanged=before)


@pytest.mark.slow
def test_a_damaged_kept_checkpoint_is_one_line_naming_the_file(
    tmp_path, old_run):
  model_dir = tmp_path / "run"
  shutil.copytree(old_run, model_dir)
  # A migration that kept its copy and stopped; then the copy was damaged.
  kept = model_dir / "before_migration"
  kept.mkdir()
  for name in os.listdir(model_dir):
    if name.startswith(f"ckpt-{K}.index") or name.startswith(
        f"ckpt-{K}.data-"):
      shutil.copy2(model_dir / name, kept)
  data = sorted(p for p in os.listdir(kept) if ".data-" in p)[0]
  os.truncate(kept / data, 1000)
  before = helpers.snapshot(str(model_dir))
  proc = _train(model_dir, 2 * K, *MESH, script="migrate_split_checkpoint.py",
                check=False)
  helpers.assert_one_line_error(
      proc, "migrate_split_checkpoint.py", str(kept / data), "is damaged",
      unchanged=before)


def test_a_missing_model_dir_is_one_line_and_creates_nothing(tmp_path):
  model_dir = tmp_path / "missing"
  proc = helpers.run_script(
      "migrate_split_checkpoint.py", "--model=mlp", "--dataset=synthetic",
      "--train_steps=2",
      f"--model_dir={model_dir}", check=False)
  helpers.assert_one_line_error(proc, "migrate_split_checkpoint.py",
                                f"model_dir={str(model_dir)!r}",
                                "does not exist")
  assert not model_dir.exists()
