"""Relative paths, the form every documented command uses, from a folder
other than the repository root."""

import os
import subprocess
import sys

import pytest

from helpers import ROOT


def _train(cwd, *args):
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
  return subprocess.run(
      [sys.executable, os.path.join(ROOT, "scripts", "train.py"),
       "--model=mlp", "--dataset=synthetic", "--checkpoint_every=20",
       "--model_dir=runs/r", *args],
      cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_relative_model_dir_resumes_instead_of_starting_over(tmp_path):
  first = _train(tmp_path, "--train_steps=40")
  assert first.returncode == 0, first.stderr[-3000:]
  second = _train(tmp_path, "--train_steps=60")
  assert second.returncode == 0, second.stderr[-3000:]
  assert "Restored checkpoint" in second.stderr
  assert "ckpt-40" in second.stderr
  assert "starting from scratch" not in second.stderr
  names = sorted(os.listdir(tmp_path / "runs" / "r"))
  # Resumed at 40: a third checkpoint at 60, and 40 is still kept.
  assert "ckpt-40.index" in names and "ckpt-60.index" in names, names
