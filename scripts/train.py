"""Trains a model by name under any tf.distribute strategy.

    python scripts/train.py --model=cifar_cnn --data_dir=.../cifar-10-batches-py \
        --strategy=mirrored --global_batch_size=1024 --epochs=50 \
        --model_dir=runs/cifar

Flags are the only configuration; `--flagfile=scripts/configs/<run>.cfg`
replays a recorded experiment.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app  # pylint: disable=g-import-not-at-top
try:  # Installed: the package distloop_cli.
  from . import cli  # pylint: disable=g-import-not-at-top
except ImportError:  # python scripts/<app>.py
  from scripts import cli  # pylint: disable=g-import-not-at-top
cli.quiet_startup()  # Before TensorFlow is imported.
from absl import flags
from absl import logging
try:  # No TensorFlow in it: the flags come first.
  from . import config_flags  # pylint: disable=g-import-not-at-top
except ImportError:
  from scripts import config_flags  # pylint: disable=g-import-not-at-top

FLAGS = flags.FLAGS
_FLAGS_BEFORE = set(FLAGS)

# Every setting of a run: one flag per field of the config dataclasses
# (framework/app/config.py and the configs it nests; see
# scripts/config_flags.py). A new setting is a new field, not a flag here.
for _name in config_flags.define_flags():
  flags.declare_key_flag(_name)  # --helpshort lists them as train.py's own
# Not settings of the run's config: they act before it exists.
flags.DEFINE_integer("cpu_devices", None, "Split the CPU into this many "
                     "logical devices (replicas when there is no GPU).")
flags.DEFINE_enum("onednn", "default", ["default", "on", "off"],
                  "TensorFlow's oneDNN CPU kernels (TF_ENABLE_ONEDNN_OPTS, "
                  "read once when TensorFlow loads, so set here before it "
                  "does): default keeps TensorFlow's choice (on only for "
                  "CPUs with AVX512_VNNI/BF16 or AMX); on: ~1.5x faster "
                  "conv training steps on an AVX2-only CPU, results differ "
                  "from Eigen's kernels by rounding. Logged.")
flags.DEFINE_enum("malloc", "default", ["default", "tcmalloc"],
                  "Memory allocator: default keeps the one the process "
                  "started with (glibc's malloc unless LD_PRELOAD says "
                  "otherwise); tcmalloc starts the run again with it "
                  "preloaded, before TensorFlow loads (apt-get install "
                  "libtcmalloc-minimal4): ~1.1x one CPU process, ~1.4x each "
                  "multi-worker/mirrored CPU replica, whose steps glibc's "
                  "malloc serves with fresh mmaps. Logged.")
# Multi-process jobs.
flags.DEFINE_enum("cluster_resolver", "tf_config", ["tf_config", "slurm"],
                  "Where the cluster comes from: the TF_CONFIG environment "
                  "variable, or Slurm's (srun) variables through "
                  "SlurmClusterResolver.")
flags.DEFINE_integer("slurm_ps_tasks", 0, "--cluster_resolver=slurm: number "
                     "of ps tasks (task 0 is then the chief).")
flags.DEFINE_integer("slurm_port_base", 8888, "--cluster_resolver=slurm: "
                     "first gRPC port on each node.")
flags.DEFINE_float("startup_timeout", 120, "Seconds to wait for every task "
                   "of a multi-worker/parameter-server cluster to start "
                   "before exiting with the missing tasks named (0: wait "
                   "forever).")

# Which choices read this app's own flags (the settings declare theirs:
# `setting(read_by=...)`); a set flag they do not read is a warning.
_CLUSTER = {"strategy": ("multi_worker_mirrored", "parameter_server"),
            "model_parallel_devices": ("cluster",)}
READ_BY = {"cluster_resolver": _CLUSTER, "slurm_ps_tasks": _CLUSTER,
           "slurm_port_base": _CLUSTER, "startup_timeout": _CLUSTER}

# Recorded in TensorBoard as the run's configuration (those not at their
# default, and the key ones: see config_flags.hparams).
TRAIN_FLAGS = sorted(set(FLAGS) - _FLAGS_BEFORE)

flags.register_validator("cpu_devices", lambda v: v is None or v > 0,
                         message="--cpu_devices must be a positive integer")
flags.register_validator("startup_timeout", lambda v: v is not None and v >= 0,
                         message="--startup_timeout must be >= 0")


def config_from_flags():
  """The ExperimentConfig described by the command line."""
  return config_flags.config_from_flags(FLAGS, hparam_flags=TRAIN_FLAGS)


def _run_config(config, trainer_cls):
  """Runs `config` as this process's task; returns the final eval metrics.

  Cluster strategies: `ps` tasks, and `worker` tasks under parameter_server,
  only serve; the chief coordinates. A start-up watchdog turns a task that
  never starts into an error, and SIGTERM saves a checkpoint and exits with
  status 42 (see framework/core/preemption.py).
  """
  # pylint: disable=g-import-not-at-top
  from framework.app import experiment
  from framework.core import preemption
  from framework.distribute import cluster
  from framework.distribute.tf_config import require_tf_config
  from framework.perf import allocator
  # pylint: enable=g-import-not-at-top
  logging.info("oneDNN CPU kernels: %s (--onednn=%s)",
               "on" if cli.onednn_enabled() else "off", FLAGS.onednn)
  logging.info("memory allocator: %s (--malloc=%s)",
               "tcmalloc" if allocator.tcmalloc_loaded() else "default",
               FLAGS.malloc)
  tf_config = None
  if FLAGS.cluster_resolver == "slurm":
    os.environ["TF_CONFIG"] = json.dumps(cluster.tf_config_from_slurm(
        ps_tasks=FLAGS.slurm_ps_tasks, port_base=FLAGS.slurm_port_base))
  if config.strategy in ("multi_worker_mirrored", "parameter_server"):
    tf_config = require_tf_config(
        config.strategy, needs_ps=config.strategy == "parameter_server")
  if config.model_parallel.devices == "cluster":
    from framework.model_parallel import start_cluster  # pylint: disable=g-import-not-at-top
    tf_config = start_cluster(config.model_parallel)
    if tf_config is None:
      return None  # a worker: it served the chief until stopped
  if config.strategy == "parameter_server":
    # Recommended for every task of a parameter-server job: a lost peer
    # surfaces as an error instead of endless gRPC retries.
    os.environ.setdefault("GRPC_FAIL_FAST", "use_caller")
    if tf_config["task"]["type"] in ("worker", "ps"):
      cluster.run_server(tf_config)
      return None
  program = os.path.basename(sys.argv[0])
  # SIGTERM before training: one line, exit 143, model_dir as it was.
  preemption.guard_start(program)
  watchdog = cluster.StartupWatchdog(tf_config, timeout=FLAGS.startup_timeout,
                                     program=program)
  with watchdog:
    if config.strategy == "parameter_server":

      def prepare_ps(controller):
        # The coordinator copes with missing workers, but a missing ps
        # blocks the first loop: the cluster is up once a loop ran.
        controller.train_actions.append(
            lambda step, outputs: watchdog.started())
        # SIGTERM to the coordinator: checkpoint at the loop end, exit 42.
        preemption.install(controller)

      try:
        return experiment.run(config, trainer_cls=trainer_cls,
                              prepare_controller=prepare_ps)
      except cluster.PEER_ERRORS as e:
        # Worker failures are retried by the coordinator; what reaches here
        # is fatal (typically a lost ps task, whose variables are gone).
        raise cluster.peer_failure(e, tf_config) from None
    controllers = []

    def prepare(controller):
      # The model's variables exist: under MultiWorkerMirroredStrategy
      # their creation needed every peer, so the cluster is up.
      watchdog.started()
      preemption.install(controller)
      controllers.append(controller)

    try:
      results = experiment.run(config, trainer_cls=trainer_cls,
                               prepare_controller=prepare)
    except cluster.PEER_ERRORS as e:
      if tf_config is None:
        raise
      raise cluster.peer_failure(e, tf_config) from None
    logging.info("final weights sha256=%s",
                 weights_digest(controllers[0].trainer.model))
    return results


def weights_digest(model):
  """A digest of the model's weights (equal digests: identical weights)."""
  import hashlib  # pylint: disable=g-import-not-at-top
  digest = hashlib.sha256()
  for weight in model.weights:
    digest.update(weight.numpy().tobytes())
  return digest.hexdigest()[:16]


def run_main(trainer_cls=None):
  """Runs the app; errors a user can fix end in one line and exit code 1."""
  import framework  # pylint: disable=g-import-not-at-top
  with cli.one_line_errors():
    if FLAGS.cpu_devices:
      # Must happen before TensorFlow creates its devices.
      framework.configure_cpu_devices(FLAGS.cpu_devices)
    config = config_from_flags()
    # No trainer_cls: the dataset's task picks it (see experiment.build).
    results = _run_config(config, trainer_cls)
  if results:
    logging.info("final eval: %s", results)


_CLUSTER_STRATEGIES = ("multi_worker_mirrored", "parameter_server")


def check_tf_config_early():
  """Checks TF_CONFIG before TensorFlow's multi-second import.

  A bad cluster description then fails at once, with one line; the run
  checks it again later. `framework` imports its modules lazily and
  framework.distribute.tf_config needs no TensorFlow, so this imports none.
  """
  if (FLAGS.strategy not in _CLUSTER_STRATEGIES or
      FLAGS.cluster_resolver != "tf_config"):
    return
  from framework.distribute import tf_config  # pylint: disable=g-import-not-at-top
  # A ConfigError becomes one line (main runs this under one_line_errors).
  tf_config.require_tf_config(
      FLAGS.strategy, needs_ps=FLAGS.strategy == "parameter_server")


def warn_unread_flags():
  """One warning line naming each flag set that the run does not read
  (`--data_dir` with `--dataset=synthetic`, `--tpu` without
  `--strategy=tpu`, another model's options, ...)."""
  cli.warn_unread_flags(extra=READ_BY)


def _check_and_run():
  warn_unread_flags()
  check_tf_config_early()
  run_main()


main = cli.main_running(_check_and_run)


def entry():
  """Console entry point `distloop-train`."""
  cli.run_entry_point(main, __name__)


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
