"""MultiWorkerMirroredStrategy with real worker processes on 127.0.0.1.

One uninterrupted 2-worker run (through the launcher) is the reference: a
single process with 2 CPU replicas (`mirrored --cpu_devices=2`) must end with
the same weights, and so must a run that was preempted, killed and then
relaunched. Only the chief writes summaries, and no task leaves temporary
checkpoint directories behind. Failures (a task that never starts, bad
TF_CONFIG) are one error line; timeouts here only stop a hang.
"""

import glob
import os
import re
import signal
import subprocess
import time

import pytest

from framework.distribute import launcher
from tests import cluster_utils as cu

STEPS = 40  # the reference run's steps
MWMS = cu.MLP + ["--strategy=multi_worker_mirrored", "--checkpoint_every=5"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """(model_dir, launcher output) of an uninterrupted 2-worker run."""
  model_dir = str(tmp_path_factory.mktemp("mwms_reference"))
  # New interpreters: the test below matches event files to launch.py's pids.
  proc = cu.launch(MWMS + [f"--train_steps={STEPS}", f"--model_dir={model_dir}"],
                   fork=False)
  assert proc.returncode == 0, proc.stdout[-4000:]
  return model_dir, proc.stdout


def _event_file_pids(model_dir):
  """{pid} of the processes that wrote event files anywhere under model_dir.

  TensorFlow names them events.out.tfevents.<time>.<host>.<pid>.<n>.v2.
  """
  paths = glob.glob(os.path.join(model_dir, "**", "events.out.tfevents.*"),
                    recursive=True)
  assert paths, f"no event files under {model_dir}"
  return {int(os.path.basename(p).split(".")[-3]) for p in paths}


def _temporary_paths(model_dir):
  """What a save leaves behind if a temporary copy is not cleaned up."""
  return [p for pattern in (".tmp*", "*_temp", "*_temp_*")
          for p in glob.glob(os.path.join(model_dir, "**", pattern),
                             recursive=True)]


@pytest.mark.slow
def test_two_workers_equal_one_process_with_two_replicas(reference, tmp_path):
  model_dir, output = reference
  # Both workers end with identical weights.
  digests = [line.split("sha256=")[1].strip() for line in output.splitlines()
             if "final weights sha256=" in line]
  assert len(digests) == 2 and len(set(digests)) == 1, output[-3000:]
  assert cu.global_step(model_dir) == STEPS
  # Only the chief (worker 0) wrote summaries, and no worker left its
  # temporary checkpoint directory (or a half-written save) behind.
  pids = dict(re.findall(r"^\[launch\] (worker:\d) pid=(\d+)", output, re.M))
  assert sorted(pids) == ["worker:0", "worker:1"], output[-3000:]
  assert _event_file_pids(model_dir) == {int(pids["worker:0"])}
  assert _temporary_paths(model_dir) == []
  # TensorFlow's preemption watcher thread is stopped while every task is
  # up, not left blocked on the chief's coordination service.
  assert "PeerTerminationWatcher" not in output, output[-3000:]
  assert "Socket closed" not in output, output[-3000:]
  # The same global batches on 2 replicas in one process: the same weights.
  single = str(tmp_path / "mirrored")
  proc = cu.run_train(
      cu.MLP + ["--strategy=mirrored", "--cpu_devices=2",
                "--checkpoint_every=5", f"--train_steps={STEPS}",
                f"--model_dir={single}"], timeout=900)
  assert proc.returncode == 0, proc.stderr[-3000:]
  [single_digest] = re.findall(r"final weights sha256=(\w+)", proc.stderr)
  assert cu.global_step(single) == STEPS
  assert cu.max_weight_difference(model_dir, single) <= 1e-5
  print(f"2 workers: sha256={digests[0]}; 1 process, 2 replicas: "
        f"sha256={single_digest}")


def _start_workers(tmp_path, name, model_dir):
  cluster = launcher.local_cluster(2)
  # Far more steps than needed: the run is interrupted long before.
  args = MWMS + ["--train_steps=100000", f"--model_dir={model_dir}"]
  logs = [str(tmp_path / f"{name}_worker{i}.log") for i in range(2)]
  return [cu.start_task(cluster, "worker", i, args, logs[i])
          for i in range(2)], logs


def _interrupt(tmp_path, name, model_dir, interrupt):
  """Starts 2 workers, calls `interrupt(processes)` once they saved a new
  checkpoint; returns (exit codes, seconds to exit, logs, saved step).

  The seconds are printed, never asserted: on a loaded machine they vary.
  """
  before = cu.checkpoint_step(model_dir)
  processes, logs = _start_workers(tmp_path, name, model_dir)
  try:
    cu.wait_for_checkpoint(model_dir, before + 1, processes)
    start = time.monotonic()
    interrupt(processes)
    codes = [cu.wait_exit(p, timeout=600) for p in processes]
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


def _wait_for_line_count(path, pattern, count, job, timeout=600):
  """The `count`-th match of `pattern` in the file at `path` (the launcher's
  output) once it is there."""
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    matches = re.findall(pattern, open(path).read(), re.M)
    if len(matches) >= count:
      return matches[count - 1]
    if job.poll() is not None:
      raise AssertionError(f"launcher exited with {job.returncode}:\n"
                           + open(path).read()[-4000:])
    time.sleep(0.02)
  raise AssertionError(f"no {count} x {pattern!r} in {timeout}s")


@pytest.mark.slow
def test_max_restarts_survives_two_kill_9s_with_identical_weights(
    reference, tmp_path):
  model_dir, log = str(tmp_path / "run"), str(tmp_path / "launch.log")
  with open(log, "wb") as out:
    job = subprocess.Popen(
        cu.LAUNCH + ["--workers=2", "--max_restarts=2", "--grace_period=5",
                     "--"] + cu.train_command() + MWMS + [f"--train_steps={STEPS}",
                                                f"--model_dir={model_dir}"],
        cwd=cu.ROOT, env=cu.ENV, stdout=out, stderr=subprocess.STDOUT)
  killed_after = []
  try:
    for attempt in (1, 2):
      pid = _wait_for_line_count(log, r"^\[launch\] worker:1 pid=(\d+)",
                                 attempt, job)
      # A checkpoint written by this attempt, then kill -9 of worker 1.
      before = cu.checkpoint_step(model_dir)
      killed_after.append(cu.wait_for_checkpoint(model_dir, before + 1, [job]))
      os.kill(int(pid), signal.SIGKILL)
      _wait_for_line_count(log, r"^\[launch\] restart (\d) of 2 ", attempt,
                           job)
    code = cu.wait_exit(job, timeout=900)
  finally:
    cu.stop_all([job])
  output = open(log).read()
  assert code == 0, output[-4000:]
  assert killed_after[0] < killed_after[1] < STEPS, killed_after
  # Each restart resumed from the checkpoint before its kill (or a later one
  # saved as the job stopped), not from scratch.
  restored = [int(s) for s in re.findall(
      r"^\[worker:0\].*Restored checkpoint .*/ckpt-(\d+)", output, re.M)]
  assert len(restored) == 2 and all(
      k <= r < STEPS for k, r in zip(killed_after, restored)), restored
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
    _, stderr = process.communicate(timeout=600)
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
  code = cu.wait_exit(process, timeout=600)
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
def test_bad_tf_config_is_one_clear_line_before_tensorflow_loads(
    case, tmp_path):
  tf_config, message = BAD_TF_CONFIGS[case]
  env = {k: v for k, v in cu.ENV.items() if k != "TF_CONFIG"}
  if tf_config is not None:
    env["TF_CONFIG"] = tf_config
  # Python lists every module it imports on stderr ("import time: ...").
  env["PYTHONPROFILEIMPORTTIME"] = "1"
  model_dir = tmp_path / "run"
  proc = subprocess.run(
      cu.TRAIN + cu.MLP + ["--strategy=multi_worker_mirrored",
                           "--train_steps=10", f"--model_dir={model_dir}"],
      cwd=cu.ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 1, proc.stderr[-2000:]
  [line] = cu.error_lines(proc.stderr)
  assert line.startswith("train.py: error: ")
  assert message in line, line
  assert "Traceback" not in proc.stderr
  # TF_CONFIG is checked before TensorFlow's multi-second import, and
  # before anything is written.
  imported = re.findall(r"^import time:.*\|\s*(\S+)$", proc.stderr, re.M)
  assert "absl.flags" in imported  # the listing works
  assert "tensorflow" not in imported
  assert not model_dir.exists()


def test_peer_failure_names_the_dead_task():
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from framework.distribute import cluster  # pylint: disable=g-import-not-at-top
  error = tf.errors.UnavailableError(None, None, (
      "Collective ops is aborted by: Error reported from /job:worker/task:1: "
      "The following tasks are unhealthy (stopped sending heartbeats):\n"
      "/job:worker/replica:0/task:1\nThe tasks have crashed."))
  config = {"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
            "task": {"type": "worker", "index": 0}}
  message = str(cluster.peer_failure(error, config))
  assert "stopped sending heartbeats: worker:1" in message
  assert "\n" not in message
