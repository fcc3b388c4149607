"""What a process of a multi-process job needs besides the strategy.

- `configure_coordination_service`: MultiWorkerMirroredStrategy's peers watch
  each other through the coordination service's heartbeats; a shorter
  heartbeat timeout than TensorFlow's default turns a dead peer into an error
  in seconds instead of a long wait.
- `run_server`: `worker` and `ps` tasks of a ParameterServerStrategy job only
  serve; the coordinator (the chief) sends them work.
- `StartupWatchdog`: TensorFlow waits forever for a task that never starts;
  the watchdog exits with a message naming the tasks that are not listening.
"""

import json
import os
import re
import shutil
import socket
import subprocess
import sys

from absl import logging
import tensorflow as tf

from framework.distribute.tf_config import parse_tf_config
from framework.errors import ClusterError, ConfigError

# Seconds without heartbeats after which a peer counts as dead.
HEARTBEAT_TIMEOUT = 5

# A parameter-server worker runs each closure the coordinator sends as a
# function whose ops wait on each other and on the ps: with one inter-op
# thread the first op that blocks holds the only thread, and the job hangs
# before its first step (TF_NUM_INTEROP_THREADS=1, or a task pinned to one
# core with `taskset`).
MIN_WORKER_INTER_OP_THREADS = 2


def _cluster_spec(config):
  return tf.train.ClusterSpec(config["cluster"])


def configure_coordination_service(config=None, *,
                                   heartbeat_timeout=HEARTBEAT_TIMEOUT):
  """Configures MWMS's coordination service (call before the strategy).

  Same service as MultiWorkerMirroredStrategy would configure itself, with
  `heartbeat_timeout` seconds to notice a dead peer. A no-op without
  TF_CONFIG or when TensorFlow is already configured.
  """
  from framework import _tf_internal  # pylint: disable=g-import-not-at-top
  config = config or parse_tf_config()
  if config is None or _tf_internal.coordination_service_configured():
    return
  spec = _cluster_spec(config)
  if config["task"]["type"] not in ("chief", "worker"):
    return
  jobs = {job: spec.num_tasks(job)
          for job in ("chief", "worker") if job in spec.jobs}
  _tf_internal.configure_coordination_service(
      spec, jobs, int(heartbeat_timeout * 1000))


def run_server(config=None, *, cpu_devices=None):
  """Runs this `worker`/`ps` task's gRPC server until the process is killed.

  Args:
    cpu_devices: CPU devices the server offers (a mesh's devices of one
      task); None: one. The server makes its own devices from its
      ConfigProto, not from `tf.config`'s logical devices.
  """
  config = config or parse_tf_config()
  if config is None:
    raise ConfigError("a parameter-server worker or ps task needs TF_CONFIG")
  task = config["task"]
  session_config = None
  threads = _inter_op_threads()
  if task["type"] == "worker" and threads < MIN_WORKER_INTER_OP_THREADS:
    logging.info("inter-op threads %d -> %d: a worker with one deadlocks "
                 "on its first closure", threads, MIN_WORKER_INTER_OP_THREADS)
    session_config = tf.compat.v1.ConfigProto(
        inter_op_parallelism_threads=MIN_WORKER_INTER_OP_THREADS)
  if cpu_devices and cpu_devices > 1:
    session_config = session_config or tf.compat.v1.ConfigProto()
    session_config.device_count["CPU"] = cpu_devices
  server = tf.distribute.Server(
      _cluster_spec(config), job_name=task["type"],
      task_index=task.get("index", 0), protocol="grpc",
      config=session_config, start=True)
  logging.info("%s:%d serving at %s; waiting for the coordinator",
               task["type"], task.get("index", 0), server.target)
  server.join()


def _inter_op_threads():
  """The inter-op thread count TensorFlow will use in this process:
  tf.config's, else TF_NUM_INTEROP_THREADS, else one per schedulable core."""
  configured = tf.config.threading.get_inter_op_parallelism_threads()
  if configured > 0:
    return configured
  env = os.environ.get("TF_NUM_INTEROP_THREADS", "").strip()
  if env.isdigit() and int(env) > 0:
    return int(env)
  if hasattr(os, "sched_getaffinity"):
    return len(os.sched_getaffinity(0))
  return os.cpu_count() or 1


def _listening(address, timeout=1.0):
  host, _, port = address.rpartition(":")
  try:
    with socket.create_connection((host, int(port)), timeout=timeout):
      return True
  except OSError:
    return False


def _other_tasks(config):
  task = config["task"]
  me = (task["type"], task.get("index", 0))
  return [(f"{role}:{i}", address)
          for role, addresses in sorted(config["cluster"].items())
          for i, address in enumerate(addresses) if (role, i) != me]


def unreachable_tasks(config):
  """['role:index (address)'] of the other tasks not accepting connections."""
  return [f"{name} ({address})" for name, address in _other_tasks(config)
          if not _listening(address)]


# The watchdog runs in a small separate process: while TensorFlow waits for
# peers, the main thread is blocked in C++ holding the GIL, so neither a
# Python thread nor a signal handler of this process could act.
_WATCHDOG_CODE = r"""
import json, os, select, signal, socket, sys
parent, timeout, program, tasks = json.loads(sys.argv[1])
ready, _, _ = select.select([sys.stdin], [], [], timeout)
if ready:
  sys.exit(0)  # started (or the parent exited and closed the pipe)
def listening(address):
  host, _, port = address.rpartition(":")
  try:
    socket.create_connection((host, int(port)), timeout=1.0).close()
    return True
  except OSError:
    return False
missing = [f"{name} ({address})" for name, address in tasks
           if not listening(address)]
if missing:
  reason = "these tasks never started: " + ", ".join(missing)
else:
  reason = ("every task is listening, but the cluster did not finish "
            "starting (a task may be stuck or have another TF_CONFIG)")
print(f"{program}: error: startup_timeout={timeout:g}s passed; {reason}",
      file=sys.stderr, flush=True)
os.kill(parent, signal.SIGKILL)
"""


class StartupWatchdog:
  """Kills this process if the cluster has not started within `timeout` s.

  TensorFlow waits forever for a task that never starts. The watchdog prints
  `<program>: error: startup_timeout=...; these tasks never started: ...`
  and kills the process (exit status 137, the process being blocked inside
  TensorFlow), unless `started()` is called in time:

      with StartupWatchdog(config, timeout=120, program="train.py") as dog:
        ...              # strategy, model, first steps: needs every peer
        dog.started()

  Args:
    config: the parsed TF_CONFIG (None: the watchdog does nothing).
    timeout: seconds; 0 or None disables it.
    program: the name that starts the error line.
  """

  def __init__(self, config, *, timeout, program="distloop"):
    if timeout is not None and timeout < 0:
      raise ConfigError(f"startup_timeout={timeout} must be >= 0")
    self.config = config
    self.timeout = timeout
    self.program = program
    self._process = None

  def __enter__(self):
    if self.config is not None and self.timeout:
      args = json.dumps([os.getpid(), float(self.timeout), self.program,
                         _other_tasks(self.config)])
      self._process = subprocess.Popen(
          [sys.executable, "-c", _WATCHDOG_CODE, args],
          stdin=subprocess.PIPE)
    return self

  def started(self):
    """Marks the cluster as started; the watchdog exits."""
    if self._process is not None:
      self._process.stdin.close()
      self._process.wait()
      self._process = None

  def __exit__(self, *exc):
    self.started()


# Errors of the runtime's transport to another task: never the file system.
TRANSPORT_ERRORS = (tf.errors.UnavailableError, tf.errors.AbortedError,
                    tf.errors.CancelledError, tf.errors.DeadlineExceededError)
# Errors that mean a peer task died, restarted or cannot be reached.
PEER_ERRORS = TRANSPORT_ERRORS + (tf.errors.FailedPreconditionError,)


def peer_failure(error, config=None, *, step=None):
  """A one-line ClusterError for a TensorFlow peer error: the task that
  stopped sending heartbeats, cannot be reached or does not answer, and
  the last finished `step` (None: not known)."""
  from framework.distribute import watchdog  # pylint: disable=g-import-not-at-top
  config = config or parse_tf_config()
  lines = [l.strip() for l in str(error).splitlines() if l.strip()]
  tasks = [f"{m.group(1)}:{m.group(2)}" for l in lines
           for m in [re.match(r"/job:(\w+)/replica:\d+/task:(\d+)$", l)] if m]
  if tasks:
    detail = "stopped sending heartbeats: " + ", ".join(tasks)
  else:
    lost = unreachable_tasks(config) if config else []
    # A frozen task's connections are accepted, but it answers nothing.
    silent = [] if lost or not config else watchdog.silent_tasks(config)
    detail = ("unreachable: " + ", ".join(lost) if lost else
              "did not answer: " + ", ".join(silent) if silent else
              next((l for l in lines if "UNAVAILABLE" in l), lines[0]
                   if lines else type(error).__name__))
  at = "" if step is None else f" after step {step}"
  return ClusterError(f"a task of the cluster failed ({type(error).__name__}"
                      f"; {detail[:300]}){at}; relaunch every task to resume "
                      "from the latest checkpoint")


def tf_config_from_slurm(*, ps_tasks=0, port_base=8888, gpus_per_node=None):
  """TF_CONFIG (a dict) for this Slurm task, from `SlurmClusterResolver`.

  Without `ps_tasks` every Slurm task is a worker (MultiWorkerMirrored-
  Strategy); with `ps_tasks` there is one chief (the coordinator), the ps
  tasks and the remaining workers, assigned to SLURM_PROCIDs by the resolver
  (jobs in alphabetical order: chief, ps, worker).

  Args:
    ps_tasks: number of parameter-server tasks.
    port_base: first port; tasks sharing a node get consecutive ports.
    gpus_per_node: GPUs per node (None: nvidia-smi counts them; CPU-only
      nodes need nothing).
  """
  num_tasks = int(os.environ.get("SLURM_STEP_NUM_TASKS",
                                 os.environ.get("SLURM_NTASKS", "0")))
  if not num_tasks:
    raise ConfigError("cluster_resolver=slurm: SLURM_STEP_NUM_TASKS / "
                      "SLURM_NTASKS is not set; run the script under srun")
  workers = num_tasks - ps_tasks - (1 if ps_tasks else 0)
  if workers < 1:
    raise ConfigError(f"slurm_ps_tasks={ps_tasks} leaves no worker among "
                      f"the {num_tasks} Slurm tasks")
  jobs = ({"chief": 1, "worker": workers, "ps": ps_tasks} if ps_tasks
          else {"worker": workers})
  if gpus_per_node is not None:
    gpu_options = dict(gpus_per_node=gpus_per_node)
  elif shutil.which("nvidia-smi"):
    gpu_options = {}  # the resolver counts the GPUs itself
  else:
    # CPU-only nodes: a (never used) GPU slot per task keeps the resolver's
    # arithmetic valid; CUDA_VISIBLE_DEVICES is left alone.
    gpu_options = dict(gpus_per_node=num_tasks, gpus_per_task=1,
                       auto_set_gpu=False)
  resolver = tf.distribute.cluster_resolver.SlurmClusterResolver(
      jobs=jobs, port_base=port_base, **gpu_options)
  return {"cluster": resolver.cluster_spec().as_dict(),
          "task": {"type": resolver.task_type, "index": resolver.task_id}}
