"""Benchmark: a frozen worker (SIGSTOP) until every other process exited.

    python scripts/benchmarks/frozen_worker.py \
        --output_json=docs/results/long_runs_frozen.json

For each setup (--setups: `mwms:N`, N worker processes under
`--strategy=multi_worker_mirrored`; `mesh:N`, the tiny GPT on
`--mesh=data:N,model:2` over N worker processes plus the chief that
`launch.py` adds) and each `--collective_timeout` of --timeouts, one
`scripts/launch.py` job (new interpreters, so the pids it prints are the
tasks') trains until its first checkpoint; worker:1 then gets SIGSTOP. The
script polls every other process (the tasks and the launcher) and records
the seconds from the SIGSTOP to its exit, and each task's error line (what
ended it: the coordination service's heartbeats, a collective's deadline,
the step watchdog, or none: `launch.py` stopped it once another task had
failed). The run at --restart_timeout has `--max_restarts=1`: it goes on
to its relaunch and end, and its final weights (the latest checkpoint's
weights and optimizer slots) are compared with an uninterrupted job's of
the same command: the sha256 of every tensor's bytes and the largest
absolute difference.

Prints the host and the load average before and after: on a shared
machine every figure includes the others' load. The 12 jobs, 4 relaunches
and 4 uninterrupted runs took 23 min on a loaded 2-core host; --setups and
--timeouts run fewer.
"""

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top

from scripts.benchmarks import host  # pylint: disable=g-import-not-at-top

flags.DEFINE_list("setups", ["mwms:2", "mwms:3", "mesh:2", "mesh:3"],
                  "mwms:N or mesh:N (N worker processes; a mesh adds the "
                  "chief).")
flags.DEFINE_list("timeouts", ["10", "20", "40"],
                  "--collective_timeout values, seconds.")
flags.DEFINE_float("restart_timeout", 20, "The timeout whose run has "
                   "--max_restarts=1 and is compared with an uninterrupted "
                   "run (0: none).")
flags.DEFINE_string("output_json", None, "Write the raw figures here.")
FLAGS = flags.FLAGS

PYTHON = sys.executable
LAUNCH = os.path.join(ROOT, "scripts", "launch.py")
TRAIN = os.path.join(ROOT, "scripts", "train.py")
# The MLP on synthetic images, a global batch 2 and 3 workers divide.
MWMS = ["--strategy=multi_worker_mirrored", "--model=mlp",
        "--dataset=synthetic", "--global_batch_size=48",
        "--steps_per_loop=5", "--log_every=5", "--summary_every=5",
        "--checkpoint_every=50", "--eval_every=0",
        "--export_saved_model=false"]
MWMS_STEPS = 400
# The tiny GPT split as copy r on worker r (tests/test_frozen_peer.py).
MESH = ["--model=gpt", "--dataset=text", "--sequence_length=16",
        "--model_width=32", "--num_heads=4", "--num_layers=2",
        "--optimizer=momentum", "--momentum=0.9", "--learning_rate=0.1",
        "--steps_per_loop=1", "--log_every=1", "--summary_every=1",
        "--eval_steps=1", "--export_saved_model=false",
        "--model_parallel_devices=cluster", "--cpu_devices=2",
        "--checkpoint_every=2"]
MESH_STEPS = 12
ENDLESS = 100000  # steps of a run that only waits for its SIGSTOP


def train_args(setup, steps, model_dir, timeout):
  kind, workers = setup.split(":")
  workers = int(workers)
  if kind == "mwms":
    args = list(MWMS)
  else:
    args = MESH + [f"--mesh=data:{workers},model:2",
                   f"--global_batch_size={4 * workers}"]
  return workers, args + [f"--train_steps={steps}",
                          f"--model_dir={model_dir}",
                          f"--collective_timeout={timeout:g}"]


def alive(pid):
  """Whether `pid` runs (a zombie, exited but not yet reaped, does not)."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"
  except OSError:
    return False


def first_checkpoint(model_dir):
  path = os.path.join(model_dir, "checkpoint")
  return os.path.exists(path) and '"ckpt-' in open(path).read()


class Job:
  """launch.py in the background, its output lines timestamped."""

  def __init__(self, workers, args, max_restarts):
    self.lines = []  # (monotonic, line)
    self.process = subprocess.Popen(
        [PYTHON, LAUNCH, f"--workers={workers}",
         f"--max_restarts={max_restarts}", "--grace_period=5", "--",
         PYTHON, TRAIN, *args],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)
    self.reader = threading.Thread(target=self._read, daemon=True)
    self.reader.start()

  def _read(self):
    for line in self.process.stdout:
      self.lines.append((time.monotonic(), line.rstrip()))

  def pids(self):
    """{task: pid} of the first attempt."""
    found = {}
    for _, line in list(self.lines):
      match = re.match(r"\[launch\] (\S+) pid=(\d+)", line)
      if match and match.group(1) not in found:
        found[match.group(1)] = int(match.group(2))
      if line.startswith("[launch] restart"):
        break
    return found

  def text(self):
    return "\n".join(line for _, line in self.lines)


def wait(condition, job, timeout, what):
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if condition():
      return
    if job.process.poll() is not None:
      time.sleep(0.5)
      raise RuntimeError(f"launch.py exited {job.process.returncode} "
                         f"before {what}:\n{job.text()[-3000:]}")
    time.sleep(0.02)
  raise RuntimeError(f"no {what} in {timeout}s:\n{job.text()[-3000:]}")


def ended_by(line):
  """The mechanism an error line names."""
  if line is None:
    return "launch.py (stopped once another task failed)"
  if "stopped sending heartbeats" in line:
    return "coordination service heartbeats"
  if "--collective_timeout" in line:
    return "step watchdog"
  if "DeadlineExceededError" in line:
    return "collective deadline (coordination service)"
  return "other error"


def freeze(setup, timeout, model_dir, max_restarts, frozen="worker:1"):
  """One job: SIGSTOP `frozen` after the first checkpoint; the figures."""
  steps = ENDLESS if not max_restarts else (
      MWMS_STEPS if setup.startswith("mwms") else MESH_STEPS)
  workers, args = train_args(setup, steps, model_dir, timeout)
  job = Job(workers, args, max_restarts)
  try:
    wait(lambda: frozen in job.pids(), job, 300, f"{frozen}'s pid")
    wait(lambda: first_checkpoint(model_dir), job, 600, "first checkpoint")
    pids = job.pids()
    os.kill(pids[frozen], signal.SIGSTOP)
    stopped_at = time.monotonic()
    others = {t: p for t, p in pids.items() if t != frozen}
    others["launch.py"] = job.process.pid
    exited = {}
    # The launcher stays up to relaunch (max_restarts): its first attempt
    # ends when it says so.
    watched = dict(others)
    if max_restarts:
      del watched["launch.py"]
    deadline = stopped_at + timeout + 600
    while len(exited) < len(watched) and time.monotonic() < deadline:
      for task, pid in watched.items():
        if task not in exited and not alive(pid):
          exited[task] = round(time.monotonic() - stopped_at, 2)
      time.sleep(0.02)
    frozen_alive_after = alive(pids[frozen])
    if max_restarts:
      job.process.wait(timeout=1800)
    else:
      job.process.wait(timeout=60)
    job.reader.join(timeout=10)
  finally:
    if job.process.poll() is None:
      job.process.kill()
      job.process.wait()
    try:
      os.kill(job.pids()[frozen], signal.SIGKILL)
    except (KeyError, ProcessLookupError):
      pass
  first = job.text().split("[launch] restart")[0]
  lines = {}
  for task in pids:
    match = re.search(rf"^\[{task}\] (\S+: error: .*)$", first, re.M)
    lines[task] = match.group(1) if match else None
  step = re.search(r"after step (\d+)", " ".join(
      l for l in lines.values() if l))
  return dict(
      setup=setup, timeout=timeout, max_restarts=max_restarts,
      processes=len(pids), frozen=frozen,
      seconds_to_exit=exited,
      all_exited=max(exited.values()) if len(exited) == len(watched) else None,
      frozen_alive_when_others_exited=frozen_alive_after,
      ended_by={t: ended_by(lines[t]) for t in others if t in lines},
      lines=lines, step=int(step.group(1)) if step else None,
      launcher_lines=[l for l in first.splitlines()
                      if l.startswith("[launch]") and "pid=" not in l],
      exit_status=job.process.returncode,
      output_tail=job.text()[-1500:] if job.process.returncode else "")


def weights(model_dir):
  """{name: array} of the latest checkpoint's weights and slots."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(model_dir))
  return {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map()
          if k.startswith(("optimizer/_trainable_variables/",
                           "optimizer/_variables/", "global_step/"))}


def sha(tensors):
  digest = hashlib.sha256()
  for name in sorted(tensors):
    digest.update(name.encode())
    digest.update(np.ascontiguousarray(tensors[name]).tobytes())
  return digest.hexdigest()


def reference(setup, timeout, model_dir):
  """The same command, uninterrupted."""
  steps = MWMS_STEPS if setup.startswith("mwms") else MESH_STEPS
  workers, args = train_args(setup, steps, model_dir, timeout)
  job = Job(workers, args, 0)
  job.process.wait(timeout=1800)
  job.reader.join(timeout=10)
  if job.process.returncode:
    raise RuntimeError(f"uninterrupted {setup} failed:\n{job.text()[-3000:]}")


def main(argv):
  del argv
  started = time.monotonic()
  record = dict(host=dict(cpu=host.cpu_model(), cores=os.cpu_count(),
                          load_before=host.load_average()), rows=[])
  print(f"host: {record['host']['cpu']}, {os.cpu_count()} cores, "
        f"{record['host']['load_before']}", flush=True)
  work = tempfile.mkdtemp(prefix="frozen_worker_")
  try:
    for setup in FLAGS.setups:
      for value in FLAGS.timeouts:
        timeout = float(value)
        restarts = int(timeout == FLAGS.restart_timeout)
        model_dir = os.path.join(work, f"{setup.replace(':', '')}_{value}")
        row = freeze(setup, timeout, model_dir, restarts)
        if restarts:
          if row["exit_status"] == 0:
            clean = model_dir + "_uninterrupted"
            reference(setup, timeout, clean)
            a, b = weights(model_dir), weights(clean)
            row["weights"] = dict(
                sha256_relaunched=sha(a), sha256_uninterrupted=sha(b),
                max_abs_diff=max(float(np.max(np.abs(a[k] - b[k])))
                                 for k in a),
                tensors=len(a))
        record["rows"].append(row)
        print(json.dumps({k: v for k, v in row.items()
                          if k != "output_tail"}), flush=True)
        if row["output_tail"]:
          print(row["output_tail"], flush=True)
  finally:
    shutil.rmtree(work, ignore_errors=True)
  record["host"]["load_after"] = host.load_average()
  record["seconds"] = round(time.monotonic() - started, 1)
  print(f"{record['host']['load_after']}; {record['seconds']} s in all")
  if FLAGS.output_json:
    with open(FLAGS.output_json, "w") as f:
      json.dump(record, f, indent=1)


if __name__ == "__main__":
  app.run(main)
