"""MultiWorkerMirroredStrategy with real worker processes on 127.0.0.1.

One uninterrupted 2-worker run (through the launcher) is the reference: a
single process with 2 CPU replicas must match it, and so must runs that were
killed or preempted and then relaunched.
"""

import os
import signal
import subprocess
import time

import pytest

from framework import launcher
from tests import cluster_utils as cu

STEPS = 40  # the reference run's steps
MWMS = cu.MLP + ["--strategy=multi_worker_mirrored", "--checkpoint_every=5"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """(model_dir, launcher output) of an uninterrupted 2-worker run."""
  model_dir = str(tmp_path_factory.mktemp("mwms_reference"))
  proc = cu.launch(MWMS + [f"--train_steps={STEPS}", f"--model_dir={model_dir}"])
  assert proc.returncode == 0, proc.stdout[-4000:]
  return model_dir, proc.stdout


def _start_workers(tmp_path, name, model_dir):
  cluster = launcher.local_cluster(2)
  # Far more steps than needed: the run is interrupted long before.
  args = MWMS + ["--train_steps=100000", f"--model_dir={model_dir}"]
  logs = [str(tmp_path / f"{name}_worker{i}.log") for i in range(2)]
  return [cu.start_task(cluster, "worker", i, args, logs[i])
          for i in range(2)], logs


def _interrupt(tmp_path, name, model_dir, interrupt):
  """Starts 2 workers, calls `interrupt(processes)` once they saved a new
  checkpoint; returns (exit codes, seconds to exit, logs, saved step)."""
  before = cu.checkpoint_step(model_dir)
  processes, logs = _start_workers(tmp_path, name, model_dir)
  try:
    cu.wait_for_checkpoint(model_dir, before + 1, processes)
    start = time.monotonic()
    interrupt(processes)
    codes = [cu.wait_exit(p, timeout=60) for p in processes]
    seconds = time.monotonic() - start
  finally:
    cu.stop_all(processes)
  logs = [open(log).read() for log in logs]
  if before:
    assert f"Restored checkpoint {model_dir}/ckpt-{before}" in logs[0]
  return codes, seconds, logs, cu.checkpoint_step(model_dir)


@pytest.mark.slow
def test_preempted_then_killed_then_relaunched_equals_uninterrupted(
    reference, tmp_path):
  model_dir = str(tmp_path / "run")
  # SIGTERM to worker 1 only: both workers save the same step and exit 42.
  codes, _, logs, preempted_at = _interrupt(
      tmp_path, "preempted", model_dir,
      lambda processes: processes[1].send_signal(signal.SIGTERM))
  assert codes == [42, 42], logs[0][-3000:]
  for log in logs:
    assert f"Preempted: checkpoint saved at step {preempted_at}" in log
  # Relaunched, it resumes; SIGKILL worker 1: worker 0 fails, does not hang.
  codes, seconds, logs, killed_after = _interrupt(
      tmp_path, "killed", model_dir, lambda processes: processes[1].kill())
  assert codes == [1, -signal.SIGKILL], logs[0][-3000:]
  print(f"worker 0 exited {seconds:.1f}s after worker 1 was killed")
  assert seconds < 20, f"worker 0 took {seconds:.1f}s to notice"
  [line] = cu.error_lines(logs[0])
  assert line.startswith("train.py: error: a task of the cluster failed")
  assert "worker:1" in line
  assert preempted_at < killed_after < STEPS
  # Relaunched to the end: the same weights as never interrupted.
  relaunch = cu.launch(MWMS + [f"--train_steps={STEPS}",
                               f"--model_dir={model_dir}"])
  assert relaunch.returncode == 0, relaunch.stdout[-4000:]
  assert f"Restored checkpoint {model_dir}/ckpt-{killed_after}" in (
      relaunch.stdout)
  assert cu.max_weight_difference(reference[0], model_dir) <= 1e-6


@pytest.mark.slow
def test_sigterm_under_a_single_process_strategy_saves_a_checkpoint(tmp_path):
  model_dir = str(tmp_path / "single")
  process = subprocess.Popen(
      cu.TRAIN + cu.MLP + ["--strategy=default", "--train_steps=100000",
                           "--checkpoint_every=5", f"--model_dir={model_dir}"],
      cwd=cu.ROOT, env=cu.ENV, stdout=subprocess.DEVNULL,
      stderr=subprocess.PIPE, text=True)
  try:
    first = cu.wait_for_checkpoint(model_dir, 5, [process])
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
  finally:
    cu.stop_all([process])
  assert process.returncode == 42, stderr[-3000:]
  saved = cu.checkpoint_step(model_dir)
  assert saved >= first
  assert f"Preempted: checkpoint saved at step {saved}" in stderr
  assert cu.global_step(model_dir) == saved


@pytest.mark.slow
def test_startup_timeout_names_the_task_that_never_started(tmp_path):
  cluster = launcher.local_cluster(2)
  log = str(tmp_path / "worker0.log")
  process = cu.start_task(cluster, "worker", 0, cu.MLP + [
      "--strategy=multi_worker_mirrored", "--train_steps=10",
      "--startup_timeout=3", f"--model_dir={tmp_path / 'run'}"], log)
  code = cu.wait_exit(process, timeout=90)
  assert code != 0
  assert cu.error_lines(open(log).read()) == [
      "train.py: error: startup_timeout=3s passed; these tasks never "
      f"started: worker:1 ({cluster['worker'][1]})"]


BAD_TF_CONFIGS = {
    "malformed": ('{"cluster": {"worker": ["127.0.0.1:1"]', "not valid JSON"),
    "index_out_of_range": (
        '{"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, '
        '"task": {"type": "worker", "index": 2}}',
        "task.index=2 is out of range for cluster.worker with 2 task(s)"),
    "two_chiefs": (
        '{"cluster": {"chief": ["127.0.0.1:1", "127.0.0.1:2"], "worker": '
        '["127.0.0.1:3"]}, "task": {"type": "worker", "index": 0}}',
        "cluster.chief lists 2 addresses"),
    "address_without_port": (
        '{"cluster": {"worker": ["127.0.0.1:1", "localhost"]}, '
        '"task": {"type": "worker", "index": 0}}',
        "cluster.worker[1]='localhost' is not 'host:port'"),
    "no_tf_config": (None, "strategy=multi_worker_mirrored needs TF_CONFIG"),
}


@pytest.mark.parametrize("case", sorted(BAD_TF_CONFIGS))
def test_bad_tf_config_is_one_clear_line_within_10s(case, tmp_path):
  tf_config, message = BAD_TF_CONFIGS[case]
  env = {k: v for k, v in cu.ENV.items() if k != "TF_CONFIG"}
  if tf_config is not None:
    env["TF_CONFIG"] = tf_config
  # TF_CONFIG is checked before TensorFlow is imported.
  proc = subprocess.run(
      cu.TRAIN + cu.MLP + ["--strategy=multi_worker_mirrored",
                           "--train_steps=10", f"--model_dir={tmp_path}"],
      cwd=cu.ROOT, env=env, capture_output=True, text=True, timeout=10)
  assert proc.returncode == 1, proc.stderr[-2000:]
  [line] = cu.error_lines(proc.stderr)
  assert line.startswith("train.py: error: ")
  assert message in line, line


def test_peer_failure_names_the_dead_task():
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from framework import cluster  # pylint: disable=g-import-not-at-top
  error = tf.errors.UnavailableError(None, None, (
      "Collective ops is aborted by: Error reported from /job:worker/task:1: "
      "The following tasks are unhealthy (stopped sending heartbeats):\n"
      "/job:worker/replica:0/task:1\nThe tasks have crashed."))
  config = {"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
            "task": {"type": "worker", "index": 0}}
  message = str(cluster.peer_failure(error, config))
  assert "stopped sending heartbeats: worker:1" in message
  assert "\n" not in message
