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
"""

import ctypes
import functools
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from framework.distribute.launch_config import LaunchConfig
from framework.errors import ConfigError, check_positive
from framework.settings import default

ROLE_ORDER = ("chief", "worker", "ps", "evaluator")
CLUSTER_STRATEGIES = ("multi_worker_mirrored", "parameter_server")
# Programs whose --strategy defaults to a single-process one.
_DISTLOOP_PROGRAMS = ("train.py", "custom_step.py", "distloop-train")
_PR_SET_PDEATHSIG = 1
# The keyword defaults of the launch settings: `LaunchConfig`'s, declared once.
_default = functools.partial(default, LaunchConfig)
# Each task's file for its configuration-error line (see scripts/cli.py).
ERROR_FILE_ENV = "DISTLOOP_ERROR_FILE"


def _ephemeral_port_range():
  try:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
      low, high = (int(x) for x in f.read().split())
    return low, high
  except (OSError, ValueError):
    return None


def free_ports(count, host=_default("host")):
  """`count` distinct TCP ports on `host` that are free right now.

  Ports come from below the kernel's ephemeral range where there is room:
  a task needs a few seconds to import TensorFlow before it binds its port,
  and meanwhile a port from the ephemeral range can be taken by any
  process's outgoing connection (the gRPC channels of the tasks themselves).
  """
  ephemeral = _ephemeral_port_range()
  if ephemeral and ephemeral[0] > 12000:
    candidates = random.Random().sample(range(10000, ephemeral[0]),
                                        min(ephemeral[0] - 10000, 200))
    ports = [p for p in candidates if _bindable(host, p)][:count]
    if len(ports) == count:
      return ports
  sockets = []
  try:
    for _ in range(count):
      s = socket.socket()
      s.bind((host, 0))
      sockets.append(s)
    return [s.getsockname()[1] for s in sockets]
  finally:
    for s in sockets:
      s.close()


def _bindable(host, port):
  with socket.socket() as s:
    try:
      s.bind((host, port))
      return True
    except OSError:
      return False


def cluster_on_hosts(hosts, workers, ps=_default("ps"), *,
                     chief=_default("chief"), port=2222):
  """Like `local_cluster`, with one address of `hosts` per task (in
  `tasks_of` order) and the same `port` on each."""
  chief = ps > 0 if chief is None else chief
  counts = {"chief": int(chief), "worker": workers, "ps": ps}
  if sum(counts.values()) > len(hosts):
    raise ConfigError(f"{sum(counts.values())} tasks need as many hosts; "
                      f"got {len(hosts)}")
  addresses = iter(f"{h}:{port}" for h in hosts)
  return {role: [next(addresses) for _ in range(n)]
          for role, n in counts.items() if n}


def local_cluster(workers, ps=_default("ps"), *, chief=_default("chief"),
                  host=_default("host")):
  """A cluster dict {role: ['host:port', ...]} on free loopback ports.

  Args:
    workers: number of `worker` tasks.
    ps: number of parameter-server tasks; with `ps > 0` there is also a
      `chief` (the ParameterServerStrategy coordinator).
    chief: add a chief task (default: only when `ps > 0`).
  """
  check_positive("workers", workers)
  if isinstance(ps, bool) or not isinstance(ps, int) or ps < 0:
    raise ConfigError(f"ps={ps!r} must be an integer >= 0")
  chief = ps > 0 if chief is None else chief
  counts = {"chief": int(chief), "worker": workers, "ps": ps}
  ports = iter(free_ports(sum(counts.values()), host))
  return {role: [f"{host}:{next(ports)}" for _ in range(n)]
          for role, n in counts.items() if n}


def tf_config(cluster, task_type, index):
  """The TF_CONFIG JSON text for task `task_type:index` of `cluster`."""
  return json.dumps({"cluster": cluster,
                     "task": {"type": task_type, "index": index}})


def tasks_of(cluster):
  """[(role, index)] in a stable order: chief, workers, ps, evaluator."""
  roles = sorted(cluster, key=lambda r: (ROLE_ORDER.index(r)
                                         if r in ROLE_ORDER else 99, r))
  return [(role, i) for role in roles for i in range(len(cluster[role]))]


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
  """

  def __init__(self, command, cluster, *,
               grace_period=_default("grace_period"), env=None,
               output=None, serving_workers=False,
               max_restarts=_default("max_restarts"), new_cluster=None,
               task_prefix=None):
    check_command(command, cluster)
    if not grace_period >= 0:
      raise ConfigError(f"grace_period={grace_period} must be >= 0")
    if (isinstance(max_restarts, bool) or not isinstance(max_restarts, int)
        or max_restarts < 0):
      raise ConfigError(f"max_restarts={max_restarts!r} must be an integer "
                        ">= 0")
    self.max_restarts = max_restarts
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

  def wait(self, poll_seconds=0.1):
    """Waits for the run to end; returns its exit status (0: success)."""
    finishing = [t for t in self.processes
                 if not is_server(self.cluster, t[0], self.serving_workers)]
    while True:
      for (role, index), process in self.processes.items():
        code = process.poll()
        if code:
          self.failed_task = (role, index)
          self.configuration_error = self._read_error(role, index)
          self._print(f"[launch] {role}:{index} exited with status "
                      f"{exit_status(code)}; stopping the other tasks\n")
          self.stop()
          return exit_status(code)
      if all(self.processes[t].poll() == 0 for t in finishing):
        self.stop()
        return 0
      time.sleep(poll_seconds)

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
      self._print(f"[launch] restart {self.restarts} of {self.max_restarts}"
                  f" after {role}:{index} exited with status {status}: "
                  "starting every task again\n")
      if self.new_cluster is not None:
        self.cluster = self.new_cluster()
      self.processes = {}
      self._readers = []


def _signal_group(process, sig):
  try:
    os.killpg(process.pid, sig)
  except (ProcessLookupError, PermissionError):
    pass
