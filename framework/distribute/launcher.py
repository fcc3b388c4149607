"""Runs a whole cluster on this machine: one process per task, over loopback.

    cluster = local_cluster(workers=2, ps=1)   # chief + 2 workers + 1 ps
    exit_code = Launcher(["python", "scripts/train.py", ...], cluster).run()

Every task runs the same command with its own TF_CONFIG. Output lines are
prefixed with `role:index`. The first task to fail decides the exit status and
the others are stopped (SIGTERM, then SIGKILL after `grace_period`). Servers
that never finish by themselves (`ps` tasks, and `worker` tasks when there is
a `ps`) are stopped once every other task has exited successfully.

With `max_restarts=N` (torchrun's meaning) a failed job is not the end: every
task is stopped and the whole job starts again, up to N times; distloop's
training scripts resume from the last checkpoint of their --model_dir.
A task that ends with a configuration error (a flag absl rejects, a bad
value: distloop's one-line errors; it writes the line to the file that
$DISTLOOP_ERROR_FILE names) would fail the same way again: the job is not
restarted and its exit status is the task's.

With `min_workers=K` below the worker count a lost worker does not end the
job: a `worker` task that fails is relaunched with the job (a restart, as
above); if its relaunched process fails again within `rejoin_timeout`
seconds of the relaunch, it did not come back and is lost: the job restarts
as a cluster of one worker fewer (another restart; the survivors renumbered
0..n-1, with fresh TF_CONFIGs), at least K. A relaunched worker that runs
`rejoin_timeout` seconds is back: a later failure of it starts the count
again. The tasks resume from the last checkpoint with the same global batch
(each replica's batch grows), which for datasets whose batches are a
function of (seed, step) alone (`framework.data.config.RESIZABLE_DATASETS`)
continues the same sequence of examples.
"""

import ctypes
import functools
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

# Re-exported: `launcher.local_cluster` and friends are the documented way
# to build the cluster a Launcher runs.
from framework.distribute.cluster_spec import (  # pylint: disable=unused-import
    ROLE_ORDER, cluster_on_hosts, free_ports, local_cluster, tasks_of,
    tf_config)
from framework.distribute.config import LaunchConfig
from framework.errors import ConfigError
from framework.settings import default

CLUSTER_STRATEGIES = ("multi_worker_mirrored", "parameter_server")
# Programs whose --strategy defaults to a single-process one.
_DISTLOOP_PROGRAMS = ("train.py", "custom_step.py", "distloop-train")
_PR_SET_PDEATHSIG = 1
# The keyword defaults of the launch settings: `LaunchConfig`'s, declared once.
_default = functools.partial(default, LaunchConfig)
# Each task's file for its configuration-error line (see scripts/cli.py).
ERROR_FILE_ENV = "DISTLOOP_ERROR_FILE"


def is_server(cluster, role, serving_workers=False):
  """Whether `role` only serves (never exits by itself) in this cluster."""
  return role == "ps" or (role == "worker" and ("ps" in cluster or
                                                serving_workers))


def model_parallel_on_cluster(command):
  """Whether `command` splits a model over the workers (they only serve).

  `train.py --model_parallel_devices=cluster`: the chief runs the loop.
  """
  command = list(command)
  return "--model_parallel_devices=cluster" in command or any(
      a == "--model_parallel_devices" and b == "cluster"
      for a, b in zip(command, command[1:]))


def exit_status(returncode):
  """A shell-style exit status: 128 + signal for a task killed by a signal."""
  return 128 - returncode if returncode < 0 else returncode


def _libc_prctl():
  try:
    return ctypes.CDLL(None, use_errno=True).prctl
  except (OSError, AttributeError):  # not Linux
    return None


_PRCTL = _libc_prctl()


def _die_with_parent():
  # Runs in the child between fork and exec: only a foreign call, no
  # imports or allocations. Linux: the task gets SIGKILL if the launcher
  # itself dies (even by SIGKILL), so that no task outlives it.
  if _PRCTL is not None:
    _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _expand_flagfiles(args):
  """`args` with each readable `--flagfile=F` replaced by F's flag lines, in
  place (as absl reads them), so that the last --strategy found wins."""
  expanded = []
  for arg in args:
    if arg.startswith("--flagfile="):
      try:
        with open(arg.split("=", 1)[1]) as f:
          expanded += _expand_flagfiles(
              [l.strip() for l in f if l.strip().startswith("--")])
      except OSError:
        pass  # the task itself reports an unreadable flag file
    else:
      expanded.append(arg)
  return expanded


def command_flag(command, name):
  """The last value of `--name` in `command` (flag files read), or None."""
  args = _expand_flagfiles(list(command))
  value = None
  for i, arg in enumerate(args):
    if arg.startswith(f"--{name}="):
      value = arg.split("=", 1)[1]
    elif arg == f"--{name}" and i + 1 < len(args):
      value = args[i + 1]
  return value


def is_distloop_program(command):
  """Whether `command` runs one of distloop's training scripts."""
  return any(os.path.basename(a) in _DISTLOOP_PROGRAMS for a in command)


def check_shrink(command, cluster, min_workers, max_restarts, *,
                 resizable_datasets, dataset, global_batch_size):
  """Raises ConfigError unless the job may shrink to `min_workers` workers.

  Args:
    command, cluster: as for `Launcher`.
    min_workers, max_restarts: as for `Launcher`.
    resizable_datasets: the --dataset values whose batches do not depend
      on the worker count.
    dataset, global_batch_size: the command's defaults for the flags it
      does not set.
  """
  workers = len(cluster.get("worker", []))
  if min_workers is None or min_workers >= workers:
    return
  where = f"min_workers={min_workers} below workers={workers}"
  if "ps" in cluster or model_parallel_on_cluster(command):
    raise ConfigError(f"{where} needs a multi_worker_mirrored job (without "
                      "--ps or --model_parallel_devices=cluster)")
  if max_restarts < 2:
    raise ConfigError(f"{where} needs max_restarts >= 2 (one relaunch for a "
                      "failed worker to come back, one for the smaller "
                      f"cluster); got max_restarts={max_restarts}")
  if not is_distloop_program(command):
    return  # another program's data and batch are not distloop's to judge
  dataset = command_flag(command, "dataset") or dataset
  if dataset not in resizable_datasets:
    raise ConfigError(
        f"dataset={dataset} cannot go on with fewer workers ({where}): each "
        "worker reads its own part of its files, so the batches depend on "
        "the worker count; a shrinking job needs one of "
        f"{', '.join(resizable_datasets)}")
  batch = command_flag(command, "global_batch_size")
  try:
    batch = int(batch) if batch is not None else global_batch_size
  except ValueError:
    return  # train.py names a non-integer batch itself
  counts = range(min_workers, workers + 1)
  bad = [n for n in counts if batch % n]
  if bad:
    multiple = functools.reduce(math.lcm, counts)
    raise ConfigError(
        f"global_batch_size={batch} does not divide over "
        f"{' or '.join(map(str, bad))} workers, which {where} may run on: "
        f"use a multiple of {multiple} (e.g. "
        f"{max(multiple, batch // multiple * multiple)}) or a --min_workers "
        "whose worker counts all divide it")


def command_strategy(command):
  """The --strategy a launched command runs with, or None if unknown.

  A distloop training script without --strategy runs its default strategy;
  any other program without the flag is not distloop's to judge.
  """
  args = _expand_flagfiles(list(command))
  strategy = None
  for i, arg in enumerate(args):
    if arg.startswith("--strategy="):
      strategy = arg.split("=", 1)[1]
    elif arg == "--strategy" and i + 1 < len(args):
      strategy = args[i + 1]
  if strategy is None and any(os.path.basename(a) in _DISTLOOP_PROGRAMS
                              for a in command):
    strategy = "default"
  return strategy


def check_command(command, cluster):
  """Raises ConfigError unless `command` can run as every task of `cluster`.

  The program must exist (else every task fails to start), and a distloop
  script must use a cluster strategy: under any other strategy each task
  would train on its own, all into one model_dir.
  """
  if not command:
    raise ConfigError("no command to launch: put it after '--', e.g. "
                      "launch.py --workers=2 -- python scripts/train.py ...")
  if shutil.which(command[0]) is None:
    raise ConfigError(f"command {command[0]!r} is not an executable file or "
                      "a program on PATH")
  strategy = command_strategy(command)
  if strategy is None or model_parallel_on_cluster(command):
    # A model split over the workers: the chief alone runs the loop.
    return
  wanted = "parameter_server" if "ps" in cluster else "multi_worker_mirrored"
  if strategy not in CLUSTER_STRATEGIES:
    raise ConfigError(
        f"the launched command runs strategy={strategy}, which would start "
        f"{len(tasks_of(cluster))} independent runs; the launcher needs "
        f"--strategy={' or '.join(CLUSTER_STRATEGIES)} (here: "
        f"--strategy={wanted})")
  if strategy != wanted:
    raise ConfigError(
        f"the launched command runs strategy={strategy}, but the cluster "
        f"{'has' if 'ps' in cluster else 'has no'} ps tasks: use "
        f"--strategy={wanted}" + ("" if "ps" in cluster else " or --ps=1"))


class Launcher:
  """Starts, prefixes, watches and stops one process per task of `cluster`.

  Args:
    command: argv run for every task (TF_CONFIG differs).
    cluster: {role: [address, ...]}, e.g. from `local_cluster`.
    grace_period: seconds between SIGTERM and SIGKILL when stopping tasks.
    env: extra environment variables for every task.
    output: where prefixed lines go (default: sys.stdout).
    serving_workers: the `worker` tasks only serve (model parallelism over
      the cluster): the job ends when the chief does.
    max_restarts: after a task fails, stop every task and start the whole
      job again, at most this many times (0: the first failure ends it);
      never after a configuration error (`configuration_error`).
    new_cluster: called before each restart for fresh addresses (e.g.
      `lambda: local_cluster(2)`); default: the same `cluster` again.
    task_prefix: `f(role, index)` -> argv put before `command` for that task
      (e.g. `ip netns exec HOST`, see `framework.distribute.netns`).
    min_workers: the fewest `worker` tasks the job may shrink to when a
      worker is lost (None: never shrink; see the module docstring).
    rejoin_timeout: seconds a failed worker's relaunched process must run
      to count as back.
  """

  def __init__(self, command, cluster, *,
               grace_period=_default("grace_period"), env=None,
               output=None, serving_workers=False,
               max_restarts=_default("max_restarts"), new_cluster=None,
               task_prefix=None, min_workers=None,
               rejoin_timeout=_default("rejoin_timeout")):
    check_command(command, cluster)
    if not grace_period >= 0:
      raise ConfigError(f"grace_period={grace_period} must be >= 0")
    if (isinstance(max_restarts, bool) or not isinstance(max_restarts, int)
        or max_restarts < 0):
      raise ConfigError(f"max_restarts={max_restarts!r} must be an integer "
                        ">= 0")
    self.max_restarts = max_restarts
    self.workers = len(cluster.get("worker", []))  # now; shrinks
    self.min_workers = self.workers if min_workers is None else min_workers
    if not 1 <= self.min_workers <= max(self.workers, 1):
      raise ConfigError(f"min_workers={min_workers!r} must be an integer "
                        f"from 1 to workers={self.workers}")
    if not 0 < rejoin_timeout < float("inf"):
      raise ConfigError(f"rejoin_timeout={rejoin_timeout!r} must be a "
                        "number of seconds > 0")
    self.rejoin_timeout = rejoin_timeout
    # The worker index that failed in the last attempt (it has not shown
    # yet that it is back), and when the current attempt started.
    self._missing = None
    self._started_at = None
    self._failed_after = None  # seconds into its attempt
    self.new_cluster = new_cluster
    self.task_prefix = task_prefix
    self.restarts = 0  # how many times the job was started again
    self.failed_task = None  # (role, index) of the last failure, if any
    # The failed task's configuration-error line, if it ended with one.
    self.configuration_error = None
    self._error_dir = None
    self.command = list(command)
    self.cluster = cluster
    self.grace_period = grace_period
    self.env = dict(env or {})
    self.output = output or sys.stdout
    self.serving_workers = serving_workers
    self.processes = {}  # (role, index) -> Popen
    self._readers = []
    self._lock = threading.Lock()

  def _print(self, line):
    with self._lock:
      self.output.write(line)
      self.output.flush()

  def _pump(self, name, stream):
    for raw in iter(stream.readline, b""):
      self._print(f"[{name}] {raw.decode('utf-8', 'replace').rstrip()}\n")
    stream.close()

  def start(self):
    """Starts every task; returns {(role, index): pid}."""
    if self._error_dir is None:
      self._error_dir = tempfile.mkdtemp(prefix="distloop_launch_")
    self._started_at = time.monotonic()
    for role, index in tasks_of(self.cluster):
      env = dict(os.environ, **self.env,
                 TF_CONFIG=tf_config(self.cluster, role, index))
      env[ERROR_FILE_ENV] = self._error_file(role, index)
      if os.path.exists(env[ERROR_FILE_ENV]):
        os.remove(env[ERROR_FILE_ENV])
      prefix = list(self.task_prefix(role, index)) if self.task_prefix else []
      try:
        process = subprocess.Popen(
            prefix + self.command, env=env, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=_die_with_parent)
      except OSError as e:  # e.g. not executable; run() stops the others
        raise ConfigError(f"cannot start {self.command[0]!r} for task "
                          f"{role}:{index}: {e.strerror or e}") from None
      self.processes[(role, index)] = process
      self._print(f"[launch] {role}:{index} pid={process.pid} "
                  f"address={self.cluster[role][index]}\n")
    # Readers start after every fork: forking while other threads run can
    # leave the child holding a lock it never gets back.
    for (role, index), process in self.processes.items():
      reader = threading.Thread(target=self._pump, daemon=True,
                                args=(f"{role}:{index}", process.stdout))
      reader.start()
      self._readers.append(reader)
    return {task: p.pid for task, p in self.processes.items()}

  def wait(self, poll_interval=0.1):
    """Waits for the run to end; returns its exit status (0: success)."""
    finishing = [t for t in self.processes
                 if not is_server(self.cluster, t[0], self.serving_workers)]
    while True:
      for (role, index), process in self.processes.items():
        code = process.poll()
        if code:
          self.failed_task = (role, index)
          self._failed_after = time.monotonic() - self._started_at
          self.configuration_error = self._read_error(role, index)
          self._print(f"[launch] {role}:{index} exited with status "
                      f"{exit_status(code)}; stopping the other tasks\n")
          self.stop()
          return exit_status(code)
      if all(self.processes[t].poll() == 0 for t in finishing):
        self.stop()
        return 0
      time.sleep(poll_interval)

  def _error_file(self, role, index):
    return os.path.join(self._error_dir, f"{role}_{index}")

  def _read_error(self, role, index):
    try:
      with open(self._error_file(role, index)) as f:
        return f.read().strip() or None
    except OSError:
      return None

  def stop(self):
    """SIGTERM to every running task, SIGKILL after the grace period."""
    running = [p for p in self.processes.values() if p.poll() is None]
    for process in running:
      _signal_group(process, signal.SIGTERM)
    deadline = time.monotonic() + self.grace_period
    for process in running:
      try:
        process.wait(timeout=max(deadline - time.monotonic(), 0))
      except subprocess.TimeoutExpired:
        pass
    for process in self.processes.values():
      # Also reaps anything the task started in its own process group.
      _signal_group(process, signal.SIGKILL)
      process.wait()
    for reader in self._readers:
      reader.join(timeout=5)

  def run(self):
    """start() then wait(), again after a failure while restarts are left;
    returns the exit status of the last attempt. Always stops every task."""
    try:
      return self._run_attempts()
    finally:
      if self._error_dir is not None:
        shutil.rmtree(self._error_dir, ignore_errors=True)
        self._error_dir = None

  def _run_attempts(self):
    while True:
      try:
        self.start()
        status = self.wait()
      finally:
        self.stop()
      if status == 0 or self.restarts >= self.max_restarts:
        return status
      if self.configuration_error is not None:
        role, index = self.failed_task
        self._print(f"[launch] {role}:{index} ended with a configuration "
                    "error, which a restart cannot mend: not restarting\n")
        return status
      self.restarts += 1
      role, index = self.failed_task
      if self._lost(role, index):
        self.workers -= 1
        self._print(
            f"[launch] {role}:{index} did not come back (its relaunch "
            f"exited with status {status} within --rejoin_timeout="
            f"{self.rejoin_timeout:g}s): restart {self.restarts} of "
            f"{self.max_restarts} as a cluster of {self.workers} workers "
            f"(--min_workers={self.min_workers}), from the last checkpoint "
            "with the same global batch\n")
        self._missing = None
      else:
        self._print(f"[launch] restart {self.restarts} of "
                    f"{self.max_restarts} after {role}:{index} exited with "
                    f"status {status}: starting every task again\n")
        self._missing = index if role == "worker" else None
      if self.new_cluster is not None:
        self.cluster = self.new_cluster()
      elif self.workers < len(self.cluster.get("worker", [])):
        # The lost worker's address goes; the others are renumbered.
        self.cluster = dict(self.cluster, worker=[
            a for i, a in enumerate(self.cluster["worker"]) if i != index])
      if self.workers < len(self.cluster.get("worker", [])):
        self.cluster = dict(self.cluster,
                            worker=self.cluster["worker"][:self.workers])
      self.processes = {}
      self._readers = []

  def _lost(self, role, index):
    """Whether worker `index`, which failed in the last attempt too, failed
    again within rejoin_timeout of its relaunch and the job may shrink."""
    return (role == "worker" and self._missing == index
            and self.workers > self.min_workers
            and self._failed_after < self.rejoin_timeout)


def _signal_group(process, sig):
  try:
    os.killpg(process.pid, sig)
  except (ProcessLookupError, PermissionError):
    pass
