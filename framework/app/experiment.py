"""One training run from a frozen config: what `scripts/train.py` calls.

`run(config)` reads top to bottom as the run goes, each step once:

    resolve   the config made concrete (`run_plan`): precision, strategy and
              model split, the dataset and its task; the run lock taken
    build     the model, optimizer, trainer and Controller (`factory`)
    resume    the checkpoint checked against this run and restored, or a
              warm start (`resume`); model_info.json written
    run       `Controller.run()`: train, evaluate, checkpoint
    export    the final weights (model.weights.h5) and the SavedModel

`run_task` is one process's part of it (what `train.py` calls): Slurm,
parameter-server servers, the start-up watchdog and SIGTERM around `run`.

The registries are only defaults: `run(config, build_model=...,
train_input=..., eval_input=..., make_trainer=...)` takes a user's model,
data and trainer (a custom train step only needs `trainer_cls=...`).
"""

import hashlib
import json
import os
import time
from typing import Any, Callable, Optional, Sequence

from absl import logging
import keras
import tensorflow as tf

from models import registry
from framework.app import export, factory, resume, run_plan
from framework.app.config import ExperimentConfig
from framework.core import protocols
from framework.core import actions
from framework.core.controller import Controller, show_progress_by_default
from framework.core.checkpoints.run_files import RunLock
from framework.distribute import cluster, strategies
from framework.distribute.config import ClusterOptions
from framework.distribute.watchdog import StepWatchdog
from framework.distribute.tf_config import require_tf_config
from framework.errors import DistloopError, first_line


def run(config: ExperimentConfig, trainer_cls: Optional[type] = None,
        strategy: Optional[tf.distribute.Strategy] = None,
        prepare_controller: Optional[Callable[[Controller], Any]] = None, *,
        build_model: Optional[Callable[..., keras.Model]] = None,
        train_input: Optional[Callable[[int], Any]] = None,
        eval_input: Optional[Callable[[], Any]] = None,
        make_trainer: Optional[Callable[..., Any]] = None,
        train_actions: Sequence[Callable[[int, Any], Any]] = (),
        handle_preemption: bool = False) -> Optional[dict]:
  """Trains and evaluates per `config`; returns the final eval metrics.

  The chief also writes model_dir/model_info.json (before training), the
  final weights (model.weights.h5) and, if `export_saved_model`, a
  SavedModel (export/). `prepare_controller(controller)`, if given, is
  shown the Controller, built and resumed, before training starts; what
  the Controller runs is handed to it when it is built: `train_actions`
  (`fn(step, outputs)` after each loop, see `Controller`) and
  `handle_preemption` (SIGTERM or a first Ctrl-C saves and exits 42).

  Every keyword below replaces a default; `config.dataset` still gives the
  input shape, classes and (without `train_input`) the epoch length.

  Args:
    build_model: a module-level `build(input_shape, num_classes, **options)
      -> keras.Model` of logits, called with the `config.model_options` it
      takes; recorded as `module:function` in model_info.json (so
      `evaluate.py` / `predict.py` rebuild it). Default: `config.model`,
      a registered name or such an import path.
    train_input: `start_step -> tf.data.Dataset` of global batches (or a
      distributed dataset); see `Controller` for the contract.
    eval_input: `() -> tf.data.Dataset` of the whole eval set (or None to
      use `config.dataset`'s test split).
    make_trainer: `(model, optimizer, strategy, *, global_batch_size,
      clip_norm, nan_policy, ...) -> trainer` (default: `trainer_cls`).
  """
  # Before the first log line: absl's first one, before any flag parsing,
  # installs a root handler, which would read as logging configured.
  show_progress_by_default()
  config = run_plan.named_model(config, build_model)
  start_time = time.time()  # time_to_target counts from here
  if config.deterministic:
    tf.config.experimental.enable_op_determinism()

  # Resolve: precision, strategy and model split (before any file), then
  # the dataset and its task, once; everything below reads the plan.
  config, strategy = run_plan.place(config, strategy)
  # One writer per model_dir, locked before anything there is touched (and
  # held while the data loads: a second launch waits or fails then).
  with RunLock(config.model_dir,
               enabled=strategies.is_chief(strategy)) as lock:
    plan = run_plan.resolve(config, strategy, train_input=train_input,
                            eval_input=eval_input, placed=True,
                            trainer_cls=trainer_cls)
    # A resumed run's model is built as it was trained (its input scale).
    plan = run_plan.with_recorded_scale(
        plan, export.read_model_info_quietly(plan.config.model_dir))
    config = plan.config
    if config.check_distribution:
      # Before the real trainer exists; the build re-seeds, so the run is
      # the same with or without the check.
      factory.check_experiment(config, plan.strategy, plan.dataset,
                               trainer_cls, build_model=build_model,
                               make_trainer=make_trainer, plan=plan)

    # Build.
    trainer, controller = factory.build(
        plan, trainer_cls, build_model=build_model, train_input=train_input,
        eval_input=eval_input, make_trainer=make_trainer,
        train_actions=train_actions, start_time=start_time,
        handle_preemption=handle_preemption)

    # Resume (or warm start), then record the run: model_info.json first,
    # so that a side-car evaluator can rebuild the model.
    info = resume.resume(
        plan, trainer, controller,
        previous=export.read_model_info_quietly(config.model_dir,
                                                warn=plan.chief),
        describe=lambda: dict(
            export.model_info(config, plan.dataset, task=plan.task,
                              trainer_cls=trainer_cls),
            **export.data_sources(train_input, eval_input)))
    if plan.chief:
      lock.record()
      export.write_model_info(config.model_dir, info)

    # Run.
    if prepare_controller is not None:
      prepare_controller(controller)
    # Raises NonFiniteLossError, before the weights file is (over)written,
    # when the last loop's loss was not finite.
    results = controller.run()
    if train_input is None and hasattr(plan.dataset, "log_counts"):
      # A mixture: the examples each source gave over the whole run.
      plan.dataset.log_counts(controller.step, config.global_batch_size)

    # Export.
    if plan.chief:
      _export(config, trainer, info)
    return results


def _export(config, trainer, info):
  """The chief's final weights (and raw weights with an EMA) and, if
  `config.export_saved_model`, the SavedModel."""
  if protocols.optional(trainer, "export_model") is None:
    logging.info("trainer=%s has no export_model(): the weights file and "
                 "the export hold its model", type(trainer).__name__)
  model = protocols.export_model(trainer)
  if protocols.optional(trainer, "ema") is not None:
    export.save_weights(model, os.path.join(config.model_dir,
                                            export.RAW_WEIGHTS_FILE))
  with protocols.averaged_weights(trainer):
    export.save_weights(model, os.path.join(config.model_dir,
                                            export.WEIGHTS_FILE))
    if config.export_saved_model and info.get("task") == registry.CUSTOM:
      # The export's signature serves class probabilities.
      logging.info("task=custom: no SavedModel export (its signature "
                   "serves a classifier's probabilities); %s holds the "
                   "weights", export.WEIGHTS_FILE)
    elif config.export_saved_model:
      _export_saved_model(config, model, info)


def _export_saved_model(config, model, info):
  """The SavedModel; one warning line if TensorFlow cannot save this model:
  the training succeeded and its checkpoints and weights file are written."""
  try:
    # This run's own config named the model: its code is trusted.
    export.export_saved_model(model, info, os.path.join(
        config.model_dir, export.EXPORT_DIR), trust_model_code=True)
  except DistloopError:
    raise  # A full disk, a read-only folder: one error line, as any save.
  except Exception as e:  # pylint: disable=broad-except
    reason = first_line(e)
    reason = reason if len(reason) <= 300 else reason[:297] + "..."
    logging.warning(
        "SavedModel not exported to %s (%s: %s); the checkpoints and %s are "
        "written (--noexport_saved_model skips the export)",
        os.path.join(config.model_dir, export.EXPORT_DIR), type(e).__name__,
        reason, export.WEIGHTS_FILE)


# One process's task of a run: what `train.py` runs after parsing its flags.
#
# A single process trains. In a cluster the task comes from TF_CONFIG (or
# Slurm's variables): `ps` tasks, and `worker` tasks under parameter_server,
# only serve; the chief (or every multi-worker task) trains. A start-up
# watchdog turns a task that never starts into an error, and SIGTERM saves a
# checkpoint and exits with status 42 (`framework.core.actions`).

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
  # A bad combination is one line before the cluster is looked for.
  resume.check_async_checkpoint(config)
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
    # A frozen peer: one line and an exit, not a hang. It starts after the
    # first loop, whose tracing and compilation can take minutes.
    steps = StepWatchdog(tf_config, timeout=options.collective_timeout,
                         program=program)

    def prepare(controller):
      # The model's variables exist: under MultiWorkerMirroredStrategy
      # their creation needed every peer, so the cluster is up.
      watchdog.started()
      controllers.append(controller)  # its model's digest, after the run

    try:
      # SIGTERM once training starts: checkpoint, exit 42.
      results = run(config, trainer_cls=trainer_cls,
                    prepare_controller=prepare, handle_preemption=True,
                    train_actions=[steps.progress])
    except cluster.PEER_ERRORS as e:
      if tf_config is None:
        raise
      raise cluster.peer_failure(e, tf_config, step=steps.last_step) from None
    finally:
      steps.stop()
    logging.info("final weights sha256=%s",
                 weights_digest(controllers[0].trainer.model))
    return results


def _coordinate(config, trainer_cls, watchdog, tf_config):
  """The parameter-server chief: coordinates the workers' steps."""

  def cluster_up(step, outputs):
    # The coordinator copes with missing workers, but a missing ps blocks
    # the first loop: the cluster is up once a loop ran.
    del step, outputs
    watchdog.started()

  try:
    # SIGTERM to the coordinator: checkpoint at the loop end, exit 42.
    return run(config, trainer_cls=trainer_cls, train_actions=[cluster_up],
               handle_preemption=True)
  except cluster.PEER_ERRORS as e:
    # Worker failures are retried by the coordinator; what reaches here is
    # fatal (typically a lost ps task, whose variables are gone).
    raise cluster.peer_failure(e, tf_config) from None
