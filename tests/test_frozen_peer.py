"""A frozen peer (SIGSTOP, a hung NIC) is one line and an exit, not a hang.

The step watchdog (`framework.distribute.watchdog`) kills a task whose
loops stop finishing and names the task that did not answer; under
multi_worker_mirrored the coordination service's heartbeats usually end
the run first. With `launch.py --max_restarts` the job then resumes from
its last checkpoint and ends with the weights of an uninterrupted run.
Timeouts here only stop a hang; the seconds are printed, never asserted.
"""

import os
import re
import signal
import subprocess
import time

import pytest

from tests import cluster_utils as cu
from tests import helpers

# The watchdog in a process of its own (it SIGKILLs its process): worker:1
# is a socket whose connections the kernel accepts but nobody answers, as
# a stopped task's.
_FROZEN = """
import json, socket, sys, time
from framework.distribute.watchdog import StepWatchdog
frozen = socket.socket()
frozen.bind(("127.0.0.1", 0))
frozen.listen(8)
config = {"cluster": {"worker": ["127.0.0.1:1",
                                 "127.0.0.1:%d" % frozen.getsockname()[1]]},
          "task": {"type": "worker", "index": 0}}
with StepWatchdog(config, timeout=2, program="train.py") as dog:
  dog.progress(7)
  for _ in range(600):  # short sleeps: see BUILD.md's conventions
    time.sleep(0.1)
print("still running")
"""


def test_the_watchdog_names_the_silent_task_and_the_step_and_kills():
  proc = helpers.run_code(_FROZEN, timeout=120)
  assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
  assert "still running" not in proc.stdout
  [line] = cu.error_lines(proc.stderr)
  assert line == ("train.py: error: worker:1 did not answer "
                  "within --collective_timeout=2 s after step 7; relaunch "
                  "every task to resume from the latest checkpoint "
                  "(launch.py --max_restarts does)"), line


def test_a_watchdog_that_is_fed_and_stopped_never_fires():
  code = _FROZEN.replace(
      "  for _ in range(600):",
      "  for step in range(30):\n    dog.progress(step)\n"
      "  for _ in range(0):")
  proc = helpers.run_code(code, timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "still running" in proc.stdout
  assert cu.error_lines(proc.stderr) == []


def test_a_frozen_leader_is_named_with_the_step():
  # What the other workers get when worker 0 (the coordination service's
  # leader) is stopped: a deadline, naming no task.
  import socket  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from framework.distribute import cluster  # pylint: disable=g-import-not-at-top
  with socket.socket() as frozen:
    frozen.bind(("127.0.0.1", 0))
    frozen.listen(8)
    config = {"cluster": {"worker": [
        f"127.0.0.1:{frozen.getsockname()[1]}", "127.0.0.1:1"]},
              "task": {"type": "worker", "index": 1}}
    error = tf.errors.DeadlineExceededError(
        None, None, "Graph execution error:\n\nCollective ops is aborted by: "
        "Deadline Exceeded")
    message = str(cluster.peer_failure(error, config, step=15))
  assert message == (
      "a task of the cluster failed (DeadlineExceededError; did not answer: "
      "worker:0) after step 15; relaunch every task to resume from the "
      "latest checkpoint"), message


@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf"])
def test_a_bad_collective_timeout_is_one_line_before_anything_is_built(
    tmp_path, value):
  model_dir = tmp_path / "run"
  proc = helpers.run_script(
      "train.py", *cu.MLP, "--train_steps=2", f"--model_dir={model_dir}",
      f"--collective_timeout={value}", check=False)
  assert proc.returncode == 1, proc.stderr[-2000:]
  [line] = cu.error_lines(proc.stderr)
  assert line.startswith(f"train.py: error: collective_timeout={float(value)}"
                         " must be a number of seconds > 0"), line
  assert not model_dir.exists()


def _launch(args, log, workers=2):
  """launch.py with --max_restarts=1; the tasks are new interpreters, so
  the pids it prints are the ones to stop."""
  with open(log, "wb") as out:
    return subprocess.Popen(
        cu.LAUNCH + [f"--workers={workers}", "--max_restarts=1",
                     "--grace_period=5", "--"] + cu.TRAIN + args,
        cwd=cu.ROOT, env=cu.ENV, stdout=out, stderr=subprocess.STDOUT)


def _wait_for(log, pattern, job, timeout=600):
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    match = re.search(pattern, open(log).read(), re.M)
    if match:
      return match
    if job.poll() is not None:
      raise AssertionError(f"launcher exited with {job.returncode}:\n"
                           + open(log).read()[-4000:])
    time.sleep(0.05)
  raise AssertionError(f"no {pattern!r} in {timeout}s:\n"
                       + open(log).read()[-4000:])


def _stop_worker_1_and_relaunch(log, job, model_dir, error_pattern):
  """SIGSTOPs worker:1 after the first checkpoint; returns (its pid, the
  error line, the launcher's exit code, its output)."""
  pid = int(_wait_for(log, r"^\[launch\] worker:1 pid=(\d+)", job).group(1))
  try:
    cu.wait_for_checkpoint(model_dir, 1, [job])
    os.kill(pid, signal.SIGSTOP)
    start = time.monotonic()
    line = _wait_for(log, error_pattern, job, timeout=300).group(0)
    print(f"one line {time.monotonic() - start:.1f}s after SIGSTOP: {line}")
    _wait_for(log, r"^\[launch\] restart 1 of 1 ", job)
    code = cu.wait_exit(job, timeout=900)
  finally:
    cu.stop_all([job])
    try:
      os.kill(pid, signal.SIGKILL)  # were the launcher not to have
    except ProcessLookupError:
      pass
  return pid, line, code, open(log).read()


# Three workers: worker:1 stopped among two that go on (the two-worker case,
# one survivor, is the frozen-worker benchmark's test; the heartbeats, the
# watchdog, the relaunch and the resume are the same code for both).
@pytest.mark.slow
@pytest.mark.parametrize("workers", [3])
def test_a_stopped_multi_worker_peer_is_one_line_and_a_restart_resumes(
    tmp_path, workers):
  model_dir, log = str(tmp_path / "run"), str(tmp_path / "launch.log")
  # 48: a global batch that 2 and 3 replicas divide.
  common = cu.MLP + ["--global_batch_size=48", "--checkpoint_every=5",
                     "--train_steps=40"]
  job = _launch(common + ["--strategy=multi_worker_mirrored",
                          f"--model_dir={model_dir}",
                          "--collective_timeout=60"], log, workers=workers)
  pid, line, code, output = _stop_worker_1_and_relaunch(
      log, job, model_dir, r"train\.py: error: .*$")
  assert code == 0, output[-4000:]
  # The heartbeats (5 s) or the watchdog (60 s): either names worker:1 and
  # the step.
  assert re.search(r"worker:1.* after step \d+", line), line
  assert not cu.pids_alive([pid]), "the stopped worker outlived the job"
  assert cu.global_step(model_dir) == 40
  assert re.search(r"^\[worker:0\].*Restored checkpoint .*/ckpt-\d+", output,
                   re.M), output[-4000:]
  # The same global batches on as many replicas in one process: the same
  # weights.
  single = str(tmp_path / "mirrored")
  proc = cu.run_train(common + ["--strategy=mirrored",
                                f"--cpu_devices={workers}",
                                f"--model_dir={single}"], timeout=900)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert cu.max_weight_difference(model_dir, single) <= 1e-5


# The tiny GPT split as copy r on worker r (tests/test_model_parallel_mesh_
# cluster.py), without a coordination service: only the watchdog ends it.
_MESH = ["--model=gpt", "--dataset=text", "--sequence_length=16",
         "--model_width=32", "--num_heads=4",
         "--num_layers=2", "--optimizer=momentum", "--momentum=0.9",
         "--learning_rate=0.1", "--steps_per_loop=1", "--log_every=1",
         "--summary_every=1", "--eval_steps=1", "--export_saved_model=false",
         "--model_parallel_devices=cluster", "--cpu_devices=2",
         "--checkpoint_every=2"]
# How long the chief waits for the stopped worker. The watchdog also covers
# the restarted run's loops after its first, its checkpoints and its final
# evaluation (that evaluation's tracing: 7-8 s on a loaded 2-core host, the
# longest of them): 20 s leaves more than twice that and waits 10 s less
# than 30 did, per case.
_TIMEOUT = 20


# Two worker tasks and the chief: worker:1 stopped beside worker:0 and the
# chief, who go on. A third copy (data:3) runs the same watchdog, restart
# and resume code.
@pytest.mark.slow
@pytest.mark.parametrize("workers", [2])
def test_a_stopped_mesh_worker_is_one_line_and_a_restart_finishes(
    tmp_path, workers):
  model_dir, log = str(tmp_path / "run"), str(tmp_path / "launch.log")
  steps = 12
  mesh = _MESH + [f"--mesh=data:{workers},model:2",
                  f"--global_batch_size={4 * workers}"]
  job = _launch(mesh + [f"--train_steps={steps}", f"--model_dir={model_dir}",
                        f"--collective_timeout={_TIMEOUT}"], log,
                 workers=workers)
  _, line, code, output = _stop_worker_1_and_relaunch(
      log, job, model_dir, r"^\[chief:0\] train\.py: error: .*$")
  assert code == 0, output[-4000:]
  assert re.fullmatch(
      r"\[chief:0\] train\.py: error: worker:1 did not answer within "
      rf"--collective_timeout={_TIMEOUT} s after step \d+; relaunch every "
      r"task to resume from the latest checkpoint \(launch\.py "
      r"--max_restarts does\)",
      line), line
  assert "[launch] chief:0 exited with status 137" in output
  assert cu.global_step(model_dir) == steps
  # An uninterrupted split run: the same weights.
  reference = str(tmp_path / "reference")
  proc = cu.launch(mesh + [f"--train_steps={steps}",
                           f"--model_dir={reference}"], workers=workers)
  assert proc.returncode == 0, proc.stdout[-4000:]
  assert cu.max_weight_difference(model_dir, reference) <= 1e-6
