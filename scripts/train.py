"""Trains a model by name under any tf.distribute strategy.

    python scripts/train.py --model=cifar_cnn --data_dir=.../cifar-10-batches-py \
        --strategy=mirrored --global_batch_size=1024 --epochs=50 \
        --model_dir=runs/cifar

Flags are the only configuration; `--flagfile=scripts/configs/<run>.cfg`
replays a recorded experiment.
"""

import os
import sys

from absl import app  # pylint: disable=g-import-not-at-top
try:  # Installed: the package distloop_cli.
  from . import cli  # pylint: disable=g-import-not-at-top
except ImportError:  # python scripts/<app>.py
  from distloop_cli import cli  # pylint: disable=g-import-not-at-top
cli.quiet_startup()  # Before TensorFlow is imported.
from absl import flags
from absl import logging
try:  # No TensorFlow in it: the flags come first.
  from . import config_flags  # pylint: disable=g-import-not-at-top
except ImportError:
  from distloop_cli import config_flags  # pylint: disable=g-import-not-at-top
from framework.distribute import config as distribute_config  # pylint: disable=g-import-not-at-top
from framework.perf import allocator  # pylint: disable=g-import-not-at-top

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
flags.DEFINE_enum("malloc", allocator.DEFAULT_ALLOCATOR,
                  list(allocator.ALLOCATORS),
                  "Memory allocator: default keeps the one the process "
                  "started with (glibc's malloc unless LD_PRELOAD says "
                  "otherwise); tcmalloc starts the run again with it "
                  "preloaded, before TensorFlow loads (apt-get install "
                  "libtcmalloc-minimal4): ~1.1x one CPU process, ~1.4x each "
                  "multi-worker/mirrored CPU replica, whose steps glibc's "
                  "malloc serves with fresh mmaps. Logged.")
# Multi-process jobs (defaults: framework.distribute.config).
_CLUSTER_OPTIONS = distribute_config.ClusterOptions()
flags.DEFINE_enum("cluster_resolver", _CLUSTER_OPTIONS.resolver,
                  list(distribute_config.CLUSTER_RESOLVERS),
                  "Where the cluster comes from: the TF_CONFIG environment "
                  "variable, or Slurm's (srun) variables through "
                  "SlurmClusterResolver.")
flags.DEFINE_integer("slurm_ps_tasks", _CLUSTER_OPTIONS.slurm_ps_tasks,
                     "--cluster_resolver=slurm: number "
                     "of ps tasks (task 0 is then the chief).")
flags.DEFINE_integer("slurm_port_base", _CLUSTER_OPTIONS.slurm_port_base,
                     "--cluster_resolver=slurm: "
                     "first gRPC port on each node.")
flags.DEFINE_float("startup_timeout", _CLUSTER_OPTIONS.startup_timeout,
                   "Seconds to wait for every task "
                   "of a multi-worker/parameter-server cluster to start "
                   "before exiting with the missing tasks named (0: wait "
                   "forever).")
flags.DEFINE_float(
    "collective_timeout", _CLUSTER_OPTIONS.collective_timeout,
    "Seconds a task of a multi-worker job or a --mesh over a cluster may "
    "wait for its peers (from one finished loop to the next: its "
    "all-reduces, evaluation, checkpoint; after the last loop, the final "
    "evaluation and export) before it exits with one line "
    "naming the task that did not answer and the step; launch.py "
    "--max_restarts then restarts the job from its last checkpoint. Must "
    "be > 0. The default leaves room for the slowest healthy gap on a "
    "loaded CPU host (a loop, an evaluation, a checkpoint, the first "
    "loop's tracing and compilation: seconds to minutes). Under "
    "multi_worker_mirrored a peer that stops sending heartbeats ends the "
    "run after 5 s anyway.")

# Which choices read this app's own flags (the settings declare theirs:
# `setting(read_by=...)`); a set flag they do not read is a warning.
_CLUSTER = {"strategy": ("multi_worker_mirrored", "parameter_server"),
            "model_parallel_devices": ("cluster",)}
READ_BY = {"cluster_resolver": _CLUSTER, "slurm_ps_tasks": _CLUSTER,
           "slurm_port_base": _CLUSTER, "startup_timeout": _CLUSTER,
           "collective_timeout": {"strategy": ("multi_worker_mirrored",),
                                  "model_parallel_devices": ("cluster",)}}

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
  """Runs `config` as this process's task (`framework.app.experiment.run_task`:
  Slurm, parameter-server servers, the start-up watchdog, SIGTERM);
  returns the final eval metrics."""
  # pylint: disable=g-import-not-at-top
  from framework.app import experiment
  from framework.perf import allocator
  # pylint: enable=g-import-not-at-top
  logging.info("oneDNN CPU kernels: %s (--onednn=%s)",
               "on" if cli.onednn_enabled() else "off", FLAGS.onednn)
  logging.info("memory allocator: %s (--malloc=%s)",
               "tcmalloc" if allocator.tcmalloc_loaded() else "default",
               FLAGS.malloc)
  options = distribute_config.ClusterOptions(
      resolver=FLAGS.cluster_resolver, slurm_ps_tasks=FLAGS.slurm_ps_tasks,
      slurm_port_base=FLAGS.slurm_port_base,
      startup_timeout=FLAGS.startup_timeout,
      collective_timeout=FLAGS.collective_timeout)
  return experiment.run_task(config, trainer_cls=trainer_cls, options=options,
                       program=os.path.basename(sys.argv[0]))


def weights_digest(model):
  """A digest of the model's weights (equal digests: identical weights)."""
  from framework.app import experiment  # pylint: disable=g-import-not-at-top
  return experiment.weights_digest(model)


def run_main(trainer_cls=None):
  """Runs the app; errors a user can fix end in one line and exit code 1."""
  import framework  # pylint: disable=g-import-not-at-top
  with cli.one_line_errors():
    if FLAGS.cpu_devices:
      # Must happen before TensorFlow creates its devices.
      framework.configure_cpu_devices(FLAGS.cpu_devices)
    config = config_from_flags()
    # No trainer_cls: the dataset's task picks it (see factory.default_trainer_cls).
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
