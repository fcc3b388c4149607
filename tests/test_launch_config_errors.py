"""`launch.py --max_restarts` does not restart a configuration error.

A task that ends with distloop's configuration error (a flag absl rejects,
a bad value: the one-line errors) would fail the same way at every
attempt. It marks the error in the file $DISTLOOP_ERROR_FILE names; the
launcher then stops, prints its own line once and exits with the task's
status. Run from another folder with relative paths, as users do.
"""

import os
import re
import subprocess
import sys

import pytest

from tests import cluster_utils as cu


def _launch(tmp_path, *train_flags):
  train = os.path.relpath(cu.TRAIN[1], tmp_path)
  return subprocess.run(
      cu.LAUNCH + ["--workers=2", "--max_restarts=2", "--grace_period=1",
                   "--", cu.train_command()[0], train,
                   "--strategy=multi_worker_mirrored", *cu.MLP,
                   "--model_dir=runs/c", *train_flags],
      cwd=tmp_path, env=cu.ENV, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("flag, fragment", [
    ("--no_such_flag=1", "Unknown command line flag 'no_such_flag'"),
    ("--model=no_such_model", "no_such_model"),  # distloop's ConfigError
])
def test_a_configuration_error_is_not_restarted(tmp_path, flag, fragment):
  proc = _launch(tmp_path, "--train_steps=5", flag)
  output = proc.stdout + proc.stderr
  assert proc.returncode == 1, output
  assert "restart 1 of 2" not in output, output
  assert len(cu.launched_pids(proc.stdout)) == 2, output  # one attempt
  # Each task's line at most once (the first to fail stops the other).
  lines = [l for l in proc.stdout.splitlines() if fragment in l]
  assert 1 <= len(lines) <= 2, output
  assert len({l.split("]")[0] for l in lines}) == len(lines), output
  assert re.search(r"^\[launch\] (worker:\d) ended with a configuration "
                   r"error, which a restart cannot mend: not restarting$",
                   proc.stdout, re.M), output
  errors = cu.error_lines(proc.stderr)
  assert len(errors) == 1 and errors[0].startswith(
      "launch.py: error: worker:"), output
  assert "ended with a configuration error (exit status 1" in errors[0]
  assert not os.path.exists(tmp_path / "runs" / "c"), output


RESTARTABLE = r"""
import os, sys
# Exit 1 without the mark: a failure that a restart may mend.
sys.exit(1)
"""


def test_a_failure_without_the_mark_is_still_restarted(tmp_path):
  proc = subprocess.run(
      cu.LAUNCH + ["--workers=1", "--max_restarts=1", "--grace_period=1",
                   "--", sys.executable, "-c", RESTARTABLE],
      cwd=tmp_path, env=cu.ENV, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 1, proc.stdout + proc.stderr
  assert "[launch] restart 1 of 1 after worker:0" in proc.stdout
  assert "giving up" in proc.stderr
