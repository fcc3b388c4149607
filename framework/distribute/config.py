"""The distribute layer's settings: strategy names, where a task's cluster comes from
(`ClusterOptions`) and the local launcher's settings (`LaunchConfig`).

TensorFlow-free, so that the apps make their flags from them before TensorFlow
loads.
"""

import dataclasses
from framework.errors import ConfigError, check_choice
from framework.settings import NON_NEGATIVE, POSITIVE, check_settings, setting


STRATEGIES = ("default", "one_device", "mirrored", "multi_worker_mirrored",
              "central_storage", "parameter_server", "tpu")
# What an evaluation may run under: every strategy but parameter_server
# (its workers serve a coordinator; evaluation runs in one process).
EVAL_STRATEGIES = tuple(s for s in STRATEGIES if s != "parameter_server")


CLUSTER_RESOLVERS = ("tf_config", "slurm")

# Seconds from one finished loop to the next before a task counts its
# peers as frozen (framework.distribute.watchdog). A healthy gap holds a
# loop of the slowest peer, an evaluation and a checkpoint write, the
# first one also tracing and compilation: seconds to minutes on a loaded
# CPU host, never ten.
COLLECTIVE_TIMEOUT = 600.0


def check_collective_timeout(seconds):
  """Raises ConfigError unless `seconds` is a number > 0; returns it."""
  if (isinstance(seconds, bool) or not isinstance(seconds, (int, float))
      or not seconds > 0 or seconds == float("inf")):
    raise ConfigError(f"collective_timeout={seconds!r} must be a number of "
                      "seconds > 0 (a frozen peer is then one line, not a "
                      f"hang; default {COLLECTIVE_TIMEOUT:g})")
  return float(seconds)


@dataclasses.dataclass(frozen=True)
class ClusterOptions:
  """Where a task's cluster comes from and how long it may take to start.

  Attributes:
    resolver: `tf_config` (the TF_CONFIG variable) or `slurm` (srun's
      variables through SlurmClusterResolver).
    slurm_ps_tasks: `slurm`: ps tasks (task 0 is then the chief).
    slurm_port_base: `slurm`: the first gRPC port on each node.
    startup_timeout: seconds for every task of a multi-worker or
      parameter-server cluster to start before the run exits naming the
      missing ones (0: wait forever).
    collective_timeout: seconds a task of a multi-process job may wait for
      its peers (from one finished loop to the next: its all-reduces and
      all-gathers, a mesh's and ZeRO-1's collectives, evaluation's sums;
      after the last loop, the final evaluation and export)
      before it exits naming the task that did not answer (> 0).
  """
  resolver: str = "tf_config"
  slurm_ps_tasks: int = 0
  slurm_port_base: int = 8888
  startup_timeout: float = 120
  collective_timeout: float = COLLECTIVE_TIMEOUT

  def __post_init__(self):
    check_choice("cluster_resolver", self.resolver, CLUSTER_RESOLVERS)
    if self.slurm_ps_tasks < 0:
      raise ConfigError(f"slurm_ps_tasks={self.slurm_ps_tasks} must be >= 0")
    if self.startup_timeout is None or self.startup_timeout < 0:
      raise ConfigError(f"startup_timeout={self.startup_timeout} must be "
                        ">= 0")
    check_collective_timeout(self.collective_timeout)


# Every link's MTU lies in this range (IPv4's minimum, the largest a veth
# takes).
MTU_RANGE = (576, 65535)


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
  """A local multi-process job: its tasks, addresses, stopping and restarts.

  Attributes:
    workers: `worker` tasks.
    ps: parameter-server tasks; with `ps > 0` a chief is added.
    chief: add a chief task (None: only with `ps > 0`, or a command whose
      chief runs a split model's loop).
    host: the address every task listens on.
    grace_period: seconds between SIGTERM and SIGKILL when stopping tasks.
    netns, netns_rate, netns_mtu: each task on its own network namespace
      (`framework.distribute.netns`), its links' bandwidth and MTU.
    max_restarts: start the whole job again after a failure, at most this
      many times.
    min_workers: the fewest `worker` tasks the job may shrink to when a
      worker is lost (None: `workers`, never shrink).
    rejoin_timeout: seconds a failed worker's relaunched process must run
      to count as back; failing sooner, it is lost (see
      `framework.distribute.launcher`).
  """
  workers: int = setting(2, "Number of worker tasks.", minimum=POSITIVE)
  ps: int = setting(0, "Number of parameter-server tasks; with ps > 0 a "
                    "chief (the coordinator) is added.", minimum=NON_NEGATIVE)
  chief: bool | None = setting(
      None, "Add a chief task (default: only with --ps > 0 or a command with "
      "--model_parallel_devices=cluster, whose chief runs the loop).")
  host: str = setting("127.0.0.1", "Address every task listens on.")
  grace_period: float = setting(10.0, "Seconds between SIGTERM and SIGKILL "
                                "when stopping tasks.")
  netns: bool = setting(
      False, "Run each task in its own network namespace with its own "
      "address, joined by a bridge (a local multi-host rehearsal; needs "
      "root, ip and tc).")
  netns_rate: str = setting("", "With --netns: each link's bandwidth, e.g. "
                            "10gbit or 500mbit (tc tbf); empty: unshaped.")
  netns_mtu: int = setting(1500, "With --netns: every link's MTU (9000: "
                           "jumbo frames, as on many data-centre networks).")
  max_restarts: int = setting(
      0, "After a task fails, stop the others and start the whole job again "
      "(it resumes from its last checkpoint), at most this many times; "
      "never after a task's configuration error (a bad flag or value).",
      minimum=NON_NEGATIVE)
  min_workers: int | None = setting(
      None, "Fewest worker tasks the job may shrink to (default: --workers, "
      "never shrink). A worker that fails is relaunched with the job (a "
      "restart); if its relaunched process fails again within "
      "--rejoin_timeout it is lost, and the others restart as a cluster of "
      "one worker fewer (another restart), resume from the last checkpoint "
      "and train on the same sequence of examples with the same global "
      "batch. Needs --max_restarts >= 2, a multi_worker_mirrored job and a "
      "dataset whose batches do not depend on the worker count.")
  rejoin_timeout: float = setting(
      60.0, "With --min_workers: seconds a failed worker's relaunched "
      "process must keep running to count as back; failing sooner, it is "
      "lost and the job shrinks.")

  def __post_init__(self):
    check_settings(self)
    if self.min_workers is not None and (
        isinstance(self.min_workers, bool)
        or not isinstance(self.min_workers, int)
        or not 1 <= self.min_workers <= self.workers):
      raise ConfigError(f"min_workers={self.min_workers!r} must be an "
                        f"integer from 1 to workers={self.workers}")
    if (isinstance(self.rejoin_timeout, bool)
        or not isinstance(self.rejoin_timeout, (int, float))
        or not 0 < self.rejoin_timeout < float("inf")):
      raise ConfigError(f"rejoin_timeout={self.rejoin_timeout!r} must be a "
                        "number of seconds > 0")
    if not self.grace_period >= 0:
      raise ConfigError(f"grace_period={self.grace_period} must be >= 0")
    low, high = MTU_RANGE
    if (isinstance(self.netns_mtu, bool) or not isinstance(self.netns_mtu, int)
        or not low <= self.netns_mtu <= high):
      raise ConfigError(f"netns_mtu={self.netns_mtu!r} must be an integer in "
                        f"{low}..{high}")
