"""A checkpoint save on a full disk: its partial files are removed, and the
one line names the folder, the OS's reason, the space the checkpoint needs
(and the space free) and the last good checkpoint, without TensorFlow's
function names.

A real full tmpfs where mounting is allowed, else RLIMIT_FSIZE (then the
first save already fails). Run from another folder with relative paths.
"""

import glob
import os
import subprocess
import sys

import pytest

import disk_faults
from helpers import ROOT

COMMON = ["--model=mlp", "--dataset=synthetic", "--hidden_units=16",
          "--global_batch_size=32", "--steps_per_loop=10",
          "--checkpoint_every=10", "--export_saved_model=false",
          "--model_dir=run"]
TRAIN = os.path.join(ROOT, "scripts", "train.py")


def _train(cwd, *args, preexec_fn=None):
  return subprocess.run(
      [sys.executable, os.path.relpath(TRAIN, cwd), *COMMON, *args], cwd=cwd,
      env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"), capture_output=True,
      text=True, timeout=300, preexec_fn=preexec_fn)


def _partial_files(model_dir):
  return [p for p in glob.glob(f"{model_dir}/**", recursive=True)
          if "_temp" in os.path.basename(p) or "tempstate" in p]


@pytest.mark.slow
def test_a_save_on_a_full_disk_removes_its_partial_files(tmp_path):
  mount = tmp_path / "disk"
  mount.mkdir()
  with disk_faults.mounted(mount, "size=3m") as mounted:
    if mounted:
      first = _train(mount, "--train_steps=10")
      assert first.returncode == 0, first.stderr[-3000:]
      disk_faults.fill(mount, 64 * 1024)
      proc = _train(mount, "--train_steps=30")
      reason, last = "No space left on device", "the last good checkpoint is "
      last += str(mount / "run" / "ckpt-10") + " (unchanged)"
    else:
      proc = _train(mount, "--train_steps=30",
                    preexec_fn=disk_faults.limit_file_size)
      reason, last = "File too large", "there is no earlier checkpoint"
    model_dir = mount / "run"
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    [line] = [l for l in proc.stderr.splitlines()
              if l.startswith("train.py: error: ")]
    failed = 20 if mounted else 10
    assert line.startswith(
        f"train.py: error: cannot write checkpoint ckpt-{failed} in "
        f"{model_dir} ({reason}): it needs about "), line
    assert " MB free there" in line or " GB free there" in line, line
    assert f"the partial ckpt-{failed} was removed; {last}" in line, line
    assert "{{" not in line and "function_node" not in line, line
    assert "[Op:" not in line, line
    assert _partial_files(model_dir) == [], _partial_files(model_dir)
    assert not glob.glob(f"{model_dir}/ckpt-{failed}*")
    if mounted:
      assert os.path.exists(model_dir / "ckpt-10.index")
