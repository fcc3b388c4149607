"""Ctrl-C (SIGINT) stops a run even when the run inherited SIGINT ignored.

A shell without job control starts `train.py ... &` with SIGINT ignored,
and Python keeps that disposition: `kill -INT` during start-up did
nothing. The run is started here the same way (SIG_IGN in the child before
exec), from another folder with relative paths, and gets SIGINT early.
"""

import os
import signal
import subprocess
import threading
import time

import pytest

from tests import cluster_utils as cu

ARGS = ["--model=mlp", "--dataset=synthetic", "--hidden_units=16",
        "--global_batch_size=32", "--train_steps=1000000",
        "--steps_per_loop=100000", "--checkpoint_every=0",
        "--export_saved_model=false", "--model_dir=runs/s"]


def _ignore_sigint():
  signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.slow
def test_sigint_at_startup_stops_a_run_that_inherited_it_ignored(tmp_path):
  train = os.path.relpath(cu.TRAIN[1], tmp_path)
  process = subprocess.Popen(
      [cu.TRAIN[0], train, *ARGS], cwd=tmp_path, env=cu.ENV,
      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
      preexec_fn=_ignore_sigint)
  lines = []
  reader = threading.Thread(
      target=lambda: lines.extend(l.rstrip() for l in process.stderr),
      daemon=True)
  reader.start()
  try:
    # Flags parsed and TensorFlow imported; data and model not built yet.
    deadline = time.monotonic() + 240
    while not any("oneDNN CPU kernels" in l for l in lines):
      assert process.poll() is None, "\n".join(lines)[-3000:]
      assert time.monotonic() < deadline, "\n".join(lines)[-3000:]
      time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    try:
      code = process.wait(timeout=120)
    except subprocess.TimeoutExpired:
      code = None
  finally:
    if process.poll() is None:
      process.kill()
      process.wait()
  reader.join(timeout=10)
  stderr = "\n".join(lines)
  assert code is not None, "SIGINT ignored: still running\n" + stderr[-3000:]
  assert "Traceback" not in stderr, stderr[-3000:]
  # Before training: one line, 130; inside it: a checkpoint, 42.
  if code == 130:
    assert ("train.py: interrupted (Ctrl-C) outside the training loop; "
            "nothing was saved") in stderr, stderr[-3000:]
  else:
    assert code == 42, stderr[-3000:]
    assert "SIGINT received" in stderr, stderr[-3000:]
