"""SIGTERM before training and after it, and a model dir that cannot be
written: always one line, and the model dir as it was where nothing
trained."""

import contextlib
import errno
import logging
import os
import signal
import subprocess
import sys
import time

import pytest

from framework import ExperimentConfig
from framework.app import experiment
from framework.core import actions
from helpers import ROOT, assert_one_line_error, run_script


def test_sigterm_while_loading_the_data_is_one_line_and_leaves_no_dir(
    tmp_path):
  data_dir = tmp_path / "data"
  data_dir.mkdir()
  fifo = data_dir / "train.json"
  os.mkfifo(fifo)  # reading it blocks until a writer comes: "loading"
  model_dir = tmp_path / "run"
  process = subprocess.Popen(
      [sys.executable, os.path.join(ROOT, "scripts", "train.py"),
       "--model=mlp", "--dataset=tfrecord", f"--data_dir={data_dir}",
       "--train_steps=2", f"--model_dir={model_dir}"],
      cwd=ROOT, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  try:
    deadline = time.monotonic() + 300
    while True:  # until train.py opens the sidecar for reading
      assert process.poll() is None, process.stderr.read()[-3000:]
      assert time.monotonic() < deadline, "train.py never read the sidecar"
      try:
        writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        break
      except OSError as e:
        assert e.errno == errno.ENXIO, e  # no reader yet
        time.sleep(0.1)
    assert model_dir.is_dir()  # the run holds its lock while it loads
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    os.close(writer)
  finally:
    if process.poll() is None:
      process.kill()
      process.wait()
  assert process.returncode == actions.EXIT_TERMINATED, stderr[-3000:]
  assert stderr.rstrip().splitlines()[-1] == (
      "train.py: terminated (SIGTERM) before training started; nothing was "
      "saved")
  assert "Traceback" not in stderr
  assert not model_dir.exists()


class _Controller:
  """What _LocalPreemption uses of a Controller."""

  def __init__(self):
    self.on_train_end = []
    self.on_loop_end = []
    self.stop_requests = 0
    self.stop_reason = None
    self.parts = self  # its `request_stop`: LoopParts.request_stop

  def request_stop(self):
    self.stop_requests += 1


@pytest.mark.parametrize("order", ["signal_then_end", "end_then_signal",
                                   "signal_stops_training"])
def test_sigterm_after_training_says_it_exits_and_does(monkeypatch, caplog,
                                                       order):
  monkeypatch.setattr(actions, "_watch_signals", lambda *args: None)
  exits = []

  def fake_exit(code):
    exits.append(code)
    raise SystemExit(code)

  monkeypatch.setattr(actions.os, "_exit", fake_exit)
  caplog.set_level(logging.INFO)
  controller = _Controller()
  hook = actions._LocalPreemption(controller)  # pylint: disable=protected-access
  assert controller.on_train_end == [hook.train_ended]
  with pytest.raises(SystemExit):
    if order == "end_then_signal":  # during the final evaluation or export
      hook.train_ended(7)
      hook._on_signal(signal.SIGTERM)  # pylint: disable=protected-access
    else:
      hook._on_signal(signal.SIGTERM)  # pylint: disable=protected-access
      assert not exits and controller.stop_requests == 1
      if order == "signal_stops_training":
        # After the loop's train actions ran (this hook's among them): the
        # controller stops on the request and saves, then training ends.
        controller.stop_reason = "trainer.request_stop()"
      hook.train_ended(7)  # else: during the final save
  assert exits == [actions.EXIT_PREEMPTED]
  if order == "signal_stops_training":
    assert ("Preempted: checkpoint saved at step 7; exiting with status 42 "
            "(relaunch to resume)") in caplog.text
    assert "after training ended" not in caplog.text
  else:
    assert ("SIGTERM received after training ended: the final checkpoint "
            "(step 7) is saved; exiting now with status 42") in caplog.text


@contextlib.contextmanager
def _tmpfs(path):
  """A tmpfs at `path` (yields False if mounting is not permitted)."""
  path.mkdir()
  mounted = subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(path)],
                           capture_output=True, check=False).returncode == 0
  try:
    yield mounted
  finally:
    if mounted:
      # Lazy: a file the in-process run left open keeps the mount busy.
      subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.mark.slow
def test_evaluate_on_a_read_only_model_dir_is_one_line(tmp_path):
  with _tmpfs(tmp_path / "mnt") as mounted:
    if not mounted:
      pytest.skip("cannot mount a tmpfs here")
    model_dir = tmp_path / "mnt" / "run"
    experiment.run(ExperimentConfig(
        model="mlp", dataset="synthetic", model_dir=str(model_dir),
        global_batch_size=32, train_steps=2, export_saved_model=False,
        model_options=dict(hidden_units=(8,))))
    remount = subprocess.run(
        ["mount", "-o", "remount,ro", str(tmp_path / "mnt")],
        capture_output=True, text=True, check=False)
    if remount.returncode:
      # Busy on some hosts (files the in-process run keeps open);
      # test_evaluate.py covers a read-only model dir with chattr +i.
      pytest.skip(f"cannot remount read-only: {remount.stderr.strip()}")
    for watch in ([], ["--watch", "--timeout_seconds=30"]):
      proc = run_script("evaluate.py", f"--model_dir={model_dir}", *watch,
                        check=False)
      assert_one_line_error(proc, "evaluate.py", "cannot write",
                            "Read-only file system")
