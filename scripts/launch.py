"""Runs a multi-worker or parameter-server job locally, one process per task.

    python scripts/launch.py --workers=2 -- \
        python scripts/train.py --strategy=multi_worker_mirrored --model=mlp ...
    python scripts/launch.py --workers=2 --ps=1 -- \
        python scripts/train.py --strategy=parameter_server --model=mlp ...

Each task gets free loopback ports and its own TF_CONFIG; its output lines are
prefixed with `role:index`. The launcher exits with the first non-zero task
status (128 + N for a task killed by signal N) after stopping the other tasks
(SIGTERM, then SIGKILL after --grace_period), and 0 when the job finished.

With --max_restarts=N (torchrun's meaning) a task's failure stops the other
tasks and starts the whole job again, on fresh ports, at most N times; the
training scripts resume from the last checkpoint in their --model_dir. After
the N-th restart fails too, the launcher prints one error line and exits with
that task's status.

With --min_workers=K (below --workers) a worker that fails, is relaunched
with the job and fails again within --rejoin_timeout seconds of that
relaunch is lost: the job restarts as a cluster of one worker fewer (at
least K), which resumes from the last checkpoint with the same global batch
and sees the examples an uninterrupted run would have seen next:

    python scripts/launch.py --workers=3 --min_workers=2 --max_restarts=3 -- \
        python scripts/train.py --strategy=multi_worker_mirrored ...

With --netns (root, Linux) each task runs on its own "host": a network
namespace with its own address (10.77.0.N), all joined by a bridge;
--netns_rate=10gbit shapes every link to that bandwidth (tc tbf) and
--netns_mtu=9000 gives the links jumbo frames. A local rehearsal of a
multi-host job, links included:

    sudo python scripts/launch.py --workers=2 --netns --netns_rate=1gbit -- \
        python scripts/train.py --strategy=multi_worker_mirrored ...
"""

import contextlib
import os
import signal
import sys

from absl import app  # pylint: disable=g-import-not-at-top
try:  # Installed: the package distloop_cli.
  from . import cli  # pylint: disable=g-import-not-at-top
except ImportError:  # python scripts/<app>.py
  from distloop_cli import cli  # pylint: disable=g-import-not-at-top
from absl import flags

try:  # No TensorFlow in them.
  from . import config_flags  # pylint: disable=g-import-not-at-top
except ImportError:
  from distloop_cli import config_flags  # pylint: disable=g-import-not-at-top
from framework.app.config import ExperimentConfig  # pylint: disable=g-import-not-at-top
from framework.data.config import RESIZABLE_DATASETS  # pylint: disable=g-import-not-at-top
from framework.distribute import launcher  # pylint: disable=g-import-not-at-top
from framework.distribute.config import LaunchConfig  # pylint: disable=g-import-not-at-top
from framework.distribute import netns  # pylint: disable=g-import-not-at-top
from framework.errors import ConfigError  # pylint: disable=g-import-not-at-top
from framework.settings import default  # pylint: disable=g-import-not-at-top

FLAGS = flags.FLAGS
# The job's settings: one flag per field of LaunchConfig
# (framework/distribute/config.py; see scripts/config_flags.py).
LAUNCH_FLAGS = config_flags.define_flags(cls=LaunchConfig)


def main(argv):
  command = argv[1:]
  with cli.one_line_errors():
    config = config_flags.build_config(LaunchConfig)
    serving = launcher.model_parallel_on_cluster(command)
    chief = config.chief if config.chief is not None else (serving or None)
    network, prefix = None, None
    # Before any network or task exists: the cluster's shape is enough.
    launcher.check_shrink(
        command, {"worker": [""] * config.workers,
                  **({"ps": [""] * config.ps} if config.ps else {})},
        config.min_workers, config.max_restarts,
        resizable_datasets=RESIZABLE_DATASETS,
        dataset=default(ExperimentConfig, "dataset"),
        global_batch_size=default(ExperimentConfig, "global_batch_size"))
    if config.netns:
      tasks = config.workers + config.ps + int(bool(
          chief if chief is not None else config.ps > 0))
      network = netns.HostNetwork(tasks, rate=config.netns_rate or None,
                                  name=f"dl{os.getpid() % 100000}",
                                  mtu=config.netns_mtu)
      hosts = {}

      def prefix(role, index):
        return network.prefix(hosts[(role, index)])
    elif config.netns_rate:
      raise ConfigError(f"netns_rate={config.netns_rate!r} needs --netns")
    elif FLAGS["netns_mtu"].present:
      raise ConfigError(f"netns_mtu={config.netns_mtu} needs --netns")
    attempts = []

    def new_cluster():
      attempts.append(None)
      if network is None:
        return launcher.local_cluster(config.workers, config.ps, chief=chief,
                                      host=config.host)
      # A fresh port at each attempt: a killed task's may still be held.
      cluster = launcher.cluster_on_hosts(
          network.addresses, config.workers, config.ps, chief=chief,
          port=2222 + len(attempts))
      for i, task in enumerate(launcher.tasks_of(cluster)):
        hosts[task] = i
      return cluster
    job = launcher.Launcher(command, new_cluster(),
                            grace_period=config.grace_period,
                            serving_workers=serving,
                            max_restarts=config.max_restarts,
                            new_cluster=new_cluster, task_prefix=prefix,
                            min_workers=config.min_workers,
                            rejoin_timeout=config.rejoin_timeout)

  def on_signal(signum, frame):
    del frame
    # Stopping the launcher stops the job; the tasks get the same signal
    # first, so that they can save a checkpoint.
    job.stop()
    sys.exit(128 + signum)

  signal.signal(signal.SIGTERM, on_signal)
  signal.signal(signal.SIGINT, on_signal)
  with cli.one_line_errors(), (network or contextlib.nullcontext()):
    status = job.run()
  if status and config.max_restarts and job.configuration_error:
    role, index = job.failed_task
    print(f"launch.py: error: {role}:{index} ended with a configuration "
          f"error (exit status {status}; its line is above); not restarted "
          f"(--max_restarts={config.max_restarts} restarts only failures a "
          "restart can mend)", file=sys.stderr)
  elif status and config.max_restarts:
    role, index = job.failed_task
    print(f"launch.py: error: {role}:{index} exited with status {status} "
          f"after {job.restarts} restart(s) (--max_restarts="
          f"{config.max_restarts}); giving up", file=sys.stderr)
  sys.exit(status)


def entry():
  """Console entry point `distloop-launch`."""
  cli.run_entry_point(main, __name__)


if __name__ == "__main__":
  app.run(main)
