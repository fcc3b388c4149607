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

import os
import socket
import sys
import threading

from absl import logging
import tensorflow as tf

from framework import strategies
from framework.errors import ConfigError

# Seconds without heartbeats after which a peer counts as dead.
HEARTBEAT_TIMEOUT = 5
STARTUP_EXIT_CODE = 1


def _cluster_spec(config):
  return tf.train.ClusterSpec(config["cluster"])


def configure_coordination_service(config=None, *,
                                   heartbeat_timeout=HEARTBEAT_TIMEOUT):
  """Configures MWMS's coordination service (call before the strategy).

  Same service as MultiWorkerMirroredStrategy would configure itself, with
  `heartbeat_timeout` seconds to notice a dead peer. A no-op without
  TF_CONFIG or when TensorFlow is already configured.
  """
  # pylint: disable=g-import-not-at-top
  from tensorflow.core.protobuf import coordination_config_pb2
  from tensorflow.python.distribute import multi_worker_util
  from tensorflow.python.eager import context
  # pylint: enable=g-import-not-at-top
  config = config or strategies.parse_tf_config()
  if config is None or context.context().coordination_service is not None:
    return
  spec = _cluster_spec(config)
  if config["task"]["type"] not in ("chief", "worker"):
    return
  jobs = [coordination_config_pb2.CoordinatedJob(
      name=job, num_tasks=spec.num_tasks(job))
          for job in ("chief", "worker") if job in spec.jobs]
  context.context().configure_coordination_service(
      service_type="standalone",
      service_leader=multi_worker_util.coordination_leader(spec),
      heartbeat_timeout_in_ms=int(heartbeat_timeout * 1000),
      coordinated_jobs=jobs)


def run_server(config=None):
  """Runs this `worker`/`ps` task's gRPC server until the process is killed."""
  config = config or strategies.parse_tf_config()
  if config is None:
    raise ConfigError("a parameter-server worker or ps task needs TF_CONFIG")
  task = config["task"]
  server = tf.distribute.Server(
      _cluster_spec(config), job_name=task["type"],
      task_index=task.get("index", 0), protocol="grpc", start=True)
  logging.info("%s:%d serving at %s; waiting for the coordinator",
               task["type"], task.get("index", 0), server.target)
  server.join()


def _listening(address, timeout=1.0):
  host, _, port = address.rpartition(":")
  try:
    with socket.create_connection((host, int(port)), timeout=timeout):
      return True
  except OSError:
    return False


def unreachable_tasks(config):
  """['role:index (address)'] of the other tasks not accepting connections."""
  task = config["task"]
  me = (task["type"], task.get("index", 0))
  return [f"{role}:{i} ({address})"
          for role, addresses in sorted(config["cluster"].items())
          for i, address in enumerate(addresses)
          if (role, i) != me and not _listening(address)]


class StartupWatchdog:
  """Exits the process if the cluster has not started within `timeout` s.

  Use as a context manager around strategy creation and the first step:

      with StartupWatchdog(config, timeout=120, program="train.py"):
        ...   # blocks until every peer is up

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
    self._started = threading.Event()
    self._thread = None

  def _watch(self):
    if self._started.wait(self.timeout):
      return
    missing = unreachable_tasks(self.config)
    if missing:
      reason = f"these tasks never started: {', '.join(missing)}"
    else:
      reason = ("every task is listening, but the cluster did not finish "
                "starting (a task may be stuck or use another TF_CONFIG)")
    print(f"{self.program}: error: startup_timeout={self.timeout:g}s "
          f"passed; {reason}", file=sys.stderr, flush=True)
    # The main thread is blocked inside TensorFlow: only _exit ends it.
    os._exit(STARTUP_EXIT_CODE)  # pylint: disable=protected-access

  def __enter__(self):
    if self.config is not None and self.timeout:
      self._thread = threading.Thread(target=self._watch, daemon=True,
                                      name="StartupWatchdog")
      self._thread.start()
    return self

  def started(self):
    """Marks the cluster as started; the watchdog stops watching."""
    self._started.set()

  def __exit__(self, *exc):
    self.started()
