"""One process's task of a run: what `train.py` runs after parsing its flags.

A single process trains. In a cluster the task comes from TF_CONFIG (or
Slurm's variables): `ps` tasks, and `worker` tasks under parameter_server,
only serve; the chief (or every multi-worker task) trains. A start-up
watchdog turns a task that never starts into an error, and SIGTERM saves a
checkpoint and exits with status 42 (`framework.core.actions`).
"""

import hashlib
import json
import os
from typing import Any, Optional

from absl import logging

from framework.app import experiment
from framework.core import actions
from framework.distribute import cluster
from framework.distribute.cluster_options import ClusterOptions
from framework.distribute.tf_config import require_tf_config

CLUSTER_STRATEGIES = ("multi_worker_mirrored", "parameter_server")


def weights_digest(model):
  """A digest of the model's weights (equal digests: identical weights)."""
  digest = hashlib.sha256()
  for weight in model.weights:
    digest.update(weight.numpy().tobytes())
  return digest.hexdigest()[:16]


def run_task(config, *, trainer_cls: Optional[type] = None,
             options: ClusterOptions = ClusterOptions(),
             program: str = "distloop") -> Optional[Any]:
  """Runs `config` as this process's task; returns the final eval metrics
  (None for a task that only served).

  Args:
    config: the run's `ExperimentConfig`.
    trainer_cls: as for `experiment.run` (None: the dataset's task picks).
    options: the `ClusterOptions`.
    program: the name that starts the watchdog's and SIGTERM's lines.
  """
  tf_config = None
  if options.resolver == "slurm":
    os.environ["TF_CONFIG"] = json.dumps(cluster.tf_config_from_slurm(
        ps_tasks=options.slurm_ps_tasks, port_base=options.slurm_port_base))
  if config.strategy in CLUSTER_STRATEGIES:
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
  # SIGTERM before training: one line, exit 143, model_dir as it was.
  actions.guard_start(program)
  watchdog = cluster.StartupWatchdog(tf_config,
                                     timeout=options.startup_timeout,
                                     program=program)
  with watchdog:
    if config.strategy == "parameter_server":
      return _coordinate(config, trainer_cls, watchdog, tf_config)
    controllers = []

    def prepare(controller):
      # The model's variables exist: under MultiWorkerMirroredStrategy
      # their creation needed every peer, so the cluster is up.
      watchdog.started()
      actions.install(controller)
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


def _coordinate(config, trainer_cls, watchdog, tf_config):
  """The parameter-server chief: coordinates the workers' steps."""

  def prepare(controller):
    # The coordinator copes with missing workers, but a missing ps blocks
    # the first loop: the cluster is up once a loop ran.
    controller.train_actions.append(lambda step, outputs: watchdog.started())
    # SIGTERM to the coordinator: checkpoint at the loop end, exit 42.
    actions.install(controller)

  try:
    return experiment.run(config, trainer_cls=trainer_cls,
                          prepare_controller=prepare)
  except cluster.PEER_ERRORS as e:
    # Worker failures are retried by the coordinator; what reaches here is
    # fatal (typically a lost ps task, whose variables are gone).
    raise cluster.peer_failure(e, tf_config) from None
