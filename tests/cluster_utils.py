"""Helpers for tests that run real multi-process clusters on 127.0.0.1.

Every timeout here only stops a hang: on a loaded 2-core machine a task can
take minutes to import TensorFlow and start, so none is a performance claim.
"""

import os
import re
import subprocess
import sys
import time

import numpy as np
import tensorflow as tf

import helpers
import zygote_client
from framework.distribute import cluster as cluster_lib
from framework.distribute import launcher

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = [sys.executable, os.path.join(ROOT, "scripts", "train.py")]
LAUNCH = [sys.executable, os.path.join(ROOT, "scripts", "launch.py")]
# A tiny, learnable job: the MLP on synthetic images.
MLP = ["--model=mlp", "--dataset=synthetic", "--global_batch_size=64",
       "--steps_per_loop=5", "--log_every=5", "--summary_every=5"]
ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")


def train_command():
  """`python scripts/train.py` for a command line that another process
  starts (launch.py's tasks): that python forks each run from the test
  zygote (tests/zygote_proxy.py). The pids that process sees are the
  proxies', not the runs'."""
  return [zygote_client.python(), TRAIN[1]]


def start_task(cluster, role, index, args, log_path):
  """Starts `train.py args` as task role:index; output goes to `log_path`."""
  env = dict(ENV, TF_CONFIG=launcher.tf_config(cluster, role, index))
  if helpers.needs_fresh_interpreter(args, env):
    with open(log_path, "ab") as log:
      process = subprocess.Popen(TRAIN + list(args), env=env, cwd=ROOT,
                                 stdout=log, stderr=subprocess.STDOUT)
  else:  # forked from the zygote (tests/zygote.py): no TensorFlow import
    process = zygote_client.popen(TRAIN[1], args, cwd=ROOT, env=env,
                                  stdout=log_path, stderr="STDOUT",
                                  append=True)
  process.log_path = log_path  # failure messages quote its tail
  process.task = f"{role}:{index}"
  return process


def run_train(args, timeout):
  """`python scripts/train.py args` to its end (forked from the zygote
  where it can be); the CompletedProcess (text output)."""
  return helpers.run_script("train.py", *args, timeout=timeout, check=False)


def log_tail(process, chars=3000):
  """The end of a `start_task` process's log, for failure messages."""
  path = getattr(process, "log_path", None)
  if not path or not os.path.exists(path):
    return ""
  lines = [l for l in open(path, errors="replace").read().splitlines()
           if "cuda" not in l.lower() and "oneDNN" not in l]
  return f"\n--- {process.task} log tail ---\n" + "\n".join(lines)[-chars:]


def wait_listening(cluster, roles, processes, timeout=600):
  """Waits until every task of `roles` in `cluster` accepts connections."""
  addresses = [a for role in roles for a in cluster.get(role, [])]
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    for process in processes:
      if process.poll() is not None:
        raise AssertionError(f"task {process.task} exited with "
                             f"{process.returncode}{log_tail(process)}")
    if all(cluster_lib._listening(a) for a in addresses):  # pylint: disable=protected-access
      return
    time.sleep(0.2)
  raise AssertionError(f"{addresses} not all listening after {timeout}s")


def launch(args, workers=2, ps=0, timeout=900, env=None, fork=True):
  """Runs scripts/launch.py; returns the CompletedProcess (text output).
  `env`: more environment variables for every task; `fork=False`: the
  tasks are new interpreters, so the pids launch.py prints are theirs."""
  train = train_command() if fork else TRAIN
  return subprocess.run(
      LAUNCH + [f"--workers={workers}", f"--ps={ps}", "--grace_period=5",
                "--"] + train + list(args),
      cwd=ROOT, env=dict(ENV, **(env or {})), capture_output=True, text=True,
      timeout=timeout)


def checkpoint_step(model_dir):
  """The step of the latest checkpoint in `model_dir` (0: none)."""
  path = tf.train.latest_checkpoint(model_dir)
  return int(path.rsplit("-", 1)[1]) if path else 0


def wait_for_checkpoint(model_dir, min_step, processes, timeout=600):
  """Waits until a checkpoint >= min_step exists; returns its step."""
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    state = os.path.join(model_dir, "checkpoint")
    if os.path.exists(state):
      match = re.search(r'"ckpt-(\d+)"', open(state).read())
      if match and int(match.group(1)) >= min_step:
        return int(match.group(1))
    for process in processes:
      if process.poll() is not None:
        raise AssertionError(f"task exited with {process.returncode} before "
                             f"a checkpoint >= {min_step} appeared"
                             f"{log_tail(process)}")
    time.sleep(0.02)
  raise AssertionError(f"no checkpoint >= {min_step} in {timeout}s")


def kill_9_a_worker_after_checkpoint(tmp_path, args, min_step, workers=2):
  """Starts `workers` MWMS tasks running train.py `args` (logs in
  `tmp_path`), SIGKILLs the last one once a checkpoint >= `min_step` exists
  in args' --model_dir, and waits for the others to end; returns the step
  of the checkpoint it waited for."""
  from framework.distribute import launcher  # pylint: disable=g-import-not-at-top
  model_dir = [a.split("=", 1)[1] for a in args
               if a.startswith("--model_dir=")][-1]
  cluster = launcher.local_cluster(workers)
  processes = [start_task(cluster, "worker", i, args,
                          str(tmp_path / f"worker{i}.log"))
               for i in range(workers)]
  try:
    killed_after = wait_for_checkpoint(model_dir, min_step, processes)
    processes[-1].kill()  # SIGKILL
    for process in processes[:-1]:
      wait_exit(process, timeout=600)
  finally:
    stop_all(processes)
  return killed_after


def kill_9_and_relaunch(tmp_path, args, steps, min_step):
  """(max |diff| of all weights and slots against an uninterrupted run,
  that run's launch output): train.py `args` on 2 MWMS workers for `steps`
  steps uninterrupted, and again with the last worker SIGKILLed once a
  checkpoint >= `min_step` exists, the cluster then relaunched to `steps`."""
  args = list(args) + ["--strategy=multi_worker_mirrored"]
  reference = str(tmp_path / "reference")
  uninterrupted = launch(args + [f"--model_dir={reference}",
                                 f"--train_steps={steps}"])
  assert uninterrupted.returncode == 0, uninterrupted.stdout[-4000:]
  model_dir = str(tmp_path / "run")
  killed_after = kill_9_a_worker_after_checkpoint(
      tmp_path, args + [f"--model_dir={model_dir}", "--train_steps=100000"],
      min_step)
  assert 0 < checkpoint_step(model_dir) < steps
  relaunch = launch(args + [f"--model_dir={model_dir}",
                            f"--train_steps={steps}"])
  assert relaunch.returncode == 0, relaunch.stdout[-4000:]
  assert "Restored checkpoint" in relaunch.stdout
  assert global_step(model_dir) == steps
  print(f"killed after checkpoint {killed_after}")
  return max_weight_difference(reference, model_dir), uninterrupted


def wait_exit(process, timeout):
  """Its exit code, or AssertionError if still running after `timeout` s."""
  try:
    return process.wait(timeout=timeout)
  except subprocess.TimeoutExpired:
    process.kill()
    process.wait()
    raise AssertionError(f"process still running {timeout}s later"
                         f"{log_tail(process)}") from None


def stop_all(processes):
  for process in processes:
    if process.poll() is None:
      process.kill()
    process.wait()


def model_weights(model_dir):
  """{name: array} of the weights and optimizer slots in the latest
  checkpoint (Keras 3 checkpoints list the weights under the optimizer)."""
  reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(model_dir))
  return {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map()
          if k.startswith(("optimizer/_trainable_variables/",
                           "optimizer/_variables/"))}


def max_weight_difference(dir_a, dir_b):
  a, b = model_weights(dir_a), model_weights(dir_b)
  assert a and a.keys() == b.keys()
  return max(float(np.max(np.abs(a[k] - b[k]))) for k in a)


def global_step(model_dir):
  reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(model_dir))
  return int(reader.get_tensor("global_step/.ATTRIBUTES/VARIABLE_VALUE"))


def error_lines(text):
  return [l for l in text.splitlines() if ": error: " in l]


def pids_alive(pids):
  alive = []
  for pid in pids:
    try:
      os.kill(pid, 0)
      # A zombie still answers; check its state.
      with open(f"/proc/{pid}/stat") as f:
        if f.read().split(")")[-1].split()[0] != "Z":
          alive.append(pid)
    except (ProcessLookupError, FileNotFoundError):
      pass
  return alive


def launched_pids(output):
  return [int(p) for p in re.findall(r"^\[launch\] \S+ pid=(\d+)", output,
                                     re.M)]
