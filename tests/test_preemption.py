"""SIGTERM and Ctrl-C in a real train.py process: the in-graph loop stops at
the next step boundary, a checkpoint is saved, the exit status is 42, and the
relaunched run ends with the weights of an uninterrupted one. A second Ctrl-C
quits at once with status 130."""

import glob
import os
import re
import signal
import subprocess
import threading
import time

import pytest

from tests import cluster_utils as cu

# One loop of many steps: a signal lands inside it.
LOOP = 100000
MLP = ["--model=mlp", "--dataset=synthetic", "--hidden_units=16",
       "--global_batch_size=32", "--optimizer=momentum",
       "--learning_rate=0.05", "--strategy=mirrored", "--cpu_devices=2",
       f"--steps_per_loop={LOOP}", "--checkpoint_every=0",
       "--export_saved_model=false"]


class Run:
  """train.py in a subprocess, its stderr collected by a thread."""

  def __init__(self, args):
    self.process = subprocess.Popen(
        cu.TRAIN + list(args), cwd=cu.ROOT, env=cu.ENV,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    self.lines = []
    self._reader = threading.Thread(target=self._read, daemon=True)
    self._reader.start()

  def _read(self):
    for line in self.process.stderr:
      self.lines.append(line.rstrip())

  @property
  def stderr(self):
    return "\n".join(self.lines)

  def wait_for(self, predicate, what, timeout=300):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
      if predicate():
        return
      if self.process.poll() is not None:
        raise AssertionError(f"exited {self.process.returncode} before "
                             f"{what}:\n{self.stderr[-3000:]}")
      time.sleep(0.05)
    raise AssertionError(f"no {what} in {timeout}s:\n{self.stderr[-3000:]}")

  def wait_training(self, model_dir):
    """Until the run is inside its first loop (the handlers are installed
    before the flags summary is written), plus a little."""
    self.wait_for(lambda: glob.glob(os.path.join(model_dir, "train", "*")),
                  "train/ events file")
    time.sleep(2)

  def finish(self, timeout=180):
    try:
      code = self.process.wait(timeout=timeout)
    finally:
      if self.process.poll() is None:
        self.process.kill()
        self.process.wait()
    self._reader.join(timeout=10)
    return code


def final_digest(stderr):
  [digest] = re.findall(r"final weights sha256=(\w+)", stderr)
  return digest


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_mid_loop_saves_that_step_and_resumes_exactly(tmp_path,
                                                             signum):
  model_dir = str(tmp_path / "run")
  run = Run(MLP + [f"--train_steps={10 * LOOP}", f"--model_dir={model_dir}"])
  run.wait_training(model_dir)
  os.kill(run.process.pid, signum)
  code = run.finish()
  assert code == 42, run.stderr[-3000:]
  assert "Traceback" not in run.stderr
  assert f"{signal.Signals(signum).name} received" in run.stderr
  saved = cu.checkpoint_step(model_dir)
  # It stopped inside the loop, not at a loop end.
  assert 0 < saved < LOOP, saved
  assert cu.global_step(model_dir) == saved
  assert f"Preempted: checkpoint saved at step {saved}" in run.stderr
  # Relaunched, it resumes there and ends where a straight run ends.
  end = saved + 7
  resumed = cu.run_train(
      MLP + [f"--train_steps={end}", f"--model_dir={model_dir}"], timeout=300)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert f"Restored checkpoint {model_dir}/ckpt-{saved}" in resumed.stderr
  straight = cu.run_train(
      MLP + [f"--train_steps={end}", f"--model_dir={tmp_path / 'straight'}"],
      timeout=300)
  assert straight.returncode == 0, straight.stderr[-3000:]
  assert final_digest(resumed.stderr) == final_digest(straight.stderr)


@pytest.mark.slow
def test_second_ctrl_c_quits_at_once_without_saving(tmp_path):
  # Slow steps (a CNN at batch 256), so the second Ctrl-C lands while the
  # first one's step still runs.
  model_dir = str(tmp_path / "run")
  run = Run(["--model=cifar_cnn", "--dataset=synthetic",
             "--global_batch_size=256", f"--steps_per_loop={LOOP}",
             "--train_steps=1000000", "--checkpoint_every=0",
             f"--model_dir={model_dir}"])
  run.wait_training(model_dir)
  run.process.send_signal(signal.SIGINT)
  run.wait_for(lambda: "SIGINT received" in run.stderr, "'SIGINT received'",
               timeout=60)
  run.process.send_signal(signal.SIGINT)
  code = run.finish(timeout=60)
  assert code == 130, run.stderr[-3000:]
  assert "Traceback" not in run.stderr
  assert "Interrupted again: exiting at once without saving" in run.stderr
  assert cu.checkpoint_step(model_dir) == 0
