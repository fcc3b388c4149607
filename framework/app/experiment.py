"""One training run from a frozen config: what `scripts/train.py` calls.

Kept out of the script so that it can be imported, tested and reused by
other apps. The registries are only defaults: `run(config, build_model=...,
train_input=..., eval_input=..., make_trainer=...)` takes a user's model,
data and trainer (a custom train step only needs `trainer_cls=...`).
"""

import contextlib
import dataclasses
import os
import time
from typing import Any, Callable, Optional

from absl import logging
import keras
import tensorflow as tf

from models import registry
from framework.app import eval_set_specs
from framework.app import export
from framework.app import check_run
from framework.app import custom_inputs
from framework.app import factory
from framework.app import old_split_checkpoint
from framework.app import run_plan
from framework.app import split_change
from framework.core import actions, optimizers, progress, protocols
from framework.core import ps_training
from framework.core import warm_start
from framework.data import augment, inputs
from framework.distribute import strategies
from framework.tasks import segmentation
from framework.app.config import ExperimentConfig
from framework.core.controller import Controller, LoopConfig
from framework.errors import ConfigError
from framework.core.run_lock import RunLock
from framework.model_parallel.parallel_layers import split_for
from framework import settings
from framework.core.trainer import Trainer

WEIGHTS_FILE = "model.weights.h5"
# With an EMA, WEIGHTS_FILE holds the averaged weights and this the raw ones.
RAW_WEIGHTS_FILE = "model.raw.weights.h5"


# Built in one place for the run and its self-check (`factory`); these names
# stay importable from here.
total_steps = factory.total_steps
default_trainer_cls = factory.default_trainer_cls
build_model_and_optimizer = factory.build_model_and_optimizer


def build(config, strategy, dataset, trainer_cls=None, *, build_model=None,
          train_input=None, eval_input=None, make_trainer=None, plan=None):
  """(trainer, controller) for `config` under `strategy` on `dataset`.

  Without `trainer_cls`, the dataset's task decides: per-pixel labels get a
  `SegmentationTrainer` (pixel accuracy, mean IoU) and mask summaries. The
  keyword arguments replace the defaults; see `run`. `plan`: the run's
  `RunPlan` (default: that of `config`, `strategy` and `dataset`).
  """
  plan = plan or run_plan.RunPlan.of(config, strategy, dataset)
  config, strategy, dataset = plan.config, plan.strategy, plan.dataset
  trainer, loop = factory.build_trainer(
      config, strategy, dataset, trainer_cls, build_model=build_model,
      make_trainer=make_trainer, plan=plan)
  # Before a parameter-server coordinator wraps the trainer; of a split
  # model the unsplit one, whose architecture any mesh (or none) shares.
  model = protocols.unsplit_model(trainer)
  # The loss scale's and the EMA's state, where the trainer declares them.
  checkpoint_items = protocols.checkpoint_items(trainer)
  augment_fn = augment.get_augmentation(config.augment)

  def default_train_input(start_step):
    return inputs.distribute_train(
        strategy, dataset, config.global_batch_size, seed=config.seed,
        start_step=start_step, augment=augment_fn,
        input_mode=config.input_mode)

  train_input = train_input or default_train_input
  eval_inputs = None
  if plan.parameter_server:
    # The coordinator schedules the steps on the workers; the Controller
    # around it is the same (framework/core/ps_training.py).
    trainer, train_input, eval_input = ps_training.coordinate(
        trainer, dataset, config.global_batch_size, seed=config.seed,
        augment=augment_fn)
    eval_set_specs.check_parameter_server(config)
  else:
    # The run's own set (eval/) and --eval_sets (eval_<name>/).
    eval_inputs = eval_set_specs.eval_inputs(config, strategy, dataset,
                                             eval_input)
    eval_input = None
  kwargs = dict(train_input=train_input, eval_input=eval_input,
                eval_inputs=eval_inputs,
                hparams=config.hparams or settings.hparams(config),
                checkpoint_items=checkpoint_items or None)
  if plan.is_segmentation:
    controller = segmentation.SegmentationController(
        trainer, loop, config.model_dir,
        samples=dataset.test_samples(3), **kwargs)
  else:
    controller = Controller(trainer, loop, config.model_dir, **kwargs)
  # One line if the loss stays at chance (double scaling, lr, frozen).
  controller.train_actions.append(actions.LossAtChance(
      dataset.num_classes, config.global_batch_size))
  run_config = export.run_config(config, model)
  if getattr(dataset, "generation", None):
    # Resuming on re-converted data (another content) is a config change.
    run_config["data_generation"] = dataset.generation
  controller.checkpoints.configure(
      restore_policy=config.restore, run_config=run_config,
      allow_config_change=config.allow_config_change)
  return trainer, controller


def run(config: ExperimentConfig, trainer_cls: Optional[type] = None,
        strategy: Optional[tf.distribute.Strategy] = None,
        prepare_controller: Optional[Callable[[Controller], Any]] = None, *,
        build_model: Optional[Callable[..., keras.Model]] = None,
        train_input: Optional[Callable[[int], Any]] = None,
        eval_input: Optional[Callable[[], Any]] = None,
        make_trainer: Optional[Callable[..., Any]] = None) -> Optional[dict]:
  """Trains and evaluates per `config`; returns the final eval metrics.

  The chief also writes model_dir/model_info.json (before training), the
  final weights (model.weights.h5) and, if `export_saved_model`, a
  SavedModel (export/). `prepare_controller(controller)`, if given, runs
  before training starts (e.g. to add `train_actions` such as
  preemption handling).

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
  progress.show_progress_by_default()
  if build_model is not None:
    path = registry.import_path_of(build_model)
    if path is None:
      raise ConfigError(
          f"build_model={build_model!r} must be a module-level function "
          "(model_info.json records it as module:function so that "
          "evaluate.py, predict.py and the export rebuild it)")
    config = dataclasses.replace(config, model=path)
    _warn_if_main(path)
  else:
    # A bad --model (or weights file) fails before any work.
    registry.check_model(config.model, config.model_options)
  start_time = time.time()  # time_to_target counts from here
  if config.deterministic:
    tf.config.experimental.enable_op_determinism()
  # Precision, strategy, model split, dataset and its task: decided here,
  # once; everything below reads the plan.
  config, strategy = run_plan.place(config, strategy)
  # One writer per model_dir, locked before anything there is touched (and
  # held while the data loads: a second launch waits or fails then).
  with RunLock(config.model_dir,
               enabled=strategies.is_chief(strategy)) as lock:
    plan = run_plan.resolve(config, strategy, train_input=train_input,
                            eval_input=eval_input, placed=True)
    return _run(plan, trainer_cls, prepare_controller, lock,
                build_model=build_model, train_input=train_input,
                eval_input=eval_input, make_trainer=make_trainer,
                start_time=start_time)


def _config_changes(model_dir, controller, config, split_entry=None):
  """{"config_changes": [...]} for model_info.json: the earlier entries,
  plus this resume's if `allow_config_change` let the configuration change,
  a longer (shorter) run re-stretched a decaying learning-rate schedule
  or the model split changed (`split_entry`, already logged); each is
  logged; {} if there never was one."""
  previous = export.read_model_info_quietly(model_dir) or {}
  history = list(previous.get("config_changes") or [])
  step = controller.step
  entry = {key: {"was": old, "now": new}
           for key, old, new in controller.checkpoints.config_changes}
  if entry:
    logging.warning(
        "%s now describes the changed configuration (%s) and records the "
        "change at step %d under config_changes", export.MODEL_INFO_FILE,
        ", ".join(entry), step)
  was, now = previous.get("train_steps"), controller.config.train_steps
  schedule = config.optimizer.schedule
  if (step and was and was != now and step < now
      and schedule in optimizers.DECAYING_SCHEDULES
      and not config.optimizer.total_steps):
    entry["train_steps"] = {"was": was, "now": now}
    entry["lr_schedule"] = {"was": f"{schedule} over {was} steps",
                            "now": f"{schedule} over {now} steps"}
    logging.warning(
        "train_steps was %d, now %d: the %s learning-rate schedule now spans "
        "%d steps, so from step %d on the rate differs from the first "
        "launch's (recorded in %s under config_changes)", was, now,
        schedule, now, step, export.MODEL_INFO_FILE)
  entry.update(split_entry or {})
  if entry:
    history.append({"step": step, **entry})
  return {"config_changes": history} if history else {}


def _warn_if_main(path):
  """Warns that a `__main__:build` model cannot be imported by name again."""
  if not path.startswith("__main__:"):
    return
  script = getattr(__import__("__main__"), "__file__", None)
  function = path.partition(":")[2]
  if script:
    module = os.path.splitext(os.path.basename(script))[0]
    how = (f"pass them --model={module}:{function} (importing {script} must "
           "then not train again: keep that under if __name__ == "
           "'__main__':)")
  else:
    how = (f"pass them --model=<module>:{function} naming a module file "
           "that defines it")
  logging.warning(
      "build_model=%s is defined in __main__: evaluate.py, predict.py and "
      "exports in other processes cannot import it from model_info.json; "
      "%s, or move it to a module and train with that", path, how)


def _run(plan, trainer_cls, prepare_controller, lock, *,
         build_model, train_input, eval_input, make_trainer, start_time):
  config, strategy, dataset = plan.config, plan.strategy, plan.dataset
  if config.check_distribution:
    # Before the real trainer exists; `build` re-seeds, so the run is the
    # same with or without the check.
    check_run.check_experiment(config, strategy, dataset, trainer_cls,
                               build_model=build_model,
                               make_trainer=make_trainer, plan=plan)
  trainer, controller = build(
      config, strategy, dataset, trainer_cls, build_model=build_model,
      train_input=train_input, eval_input=eval_input,
      make_trainer=make_trainer, plan=plan)
  if train_input is None:  # best.json's epoch
    controller.steps_per_epoch = inputs.steps_per_epoch(
        dataset.num_train_examples, config.global_batch_size)
  record = plan.record()
  if record["model_parallel"]["mode"] != "none":  # which trainer ran
    record["model_parallel"]["trainer"] = type(trainer).__name__
  previous = export.read_model_info_quietly(config.model_dir)
  whole_split = split_for(protocols.unsplit_model(trainer)) is not None
  older = contextlib.nullcontext()
  if controller.checkpoints.latest:
    # A split whose checkpoint another split cannot read: one line, first.
    split_change.check(previous, record["model_parallel"],
                       model=config.model, whole_split=whole_split)
    # A gpt split's checkpoint from before cross-mesh resume.
    older = old_split_checkpoint.restoring(
        trainer, controller.checkpoints, previous, record["model_parallel"],
        whole_split=whole_split)
  # Restore (or fail on a mismatched checkpoint) before writing anything.
  with older:
    controller.restore()
  # Only when the run has no checkpoint of its own; before anything is written.
  init = warm_start.warm_start(
      controller, config.init_checkpoint,
      skip_mismatch=config.init_skip_mismatch, exclude=config.init_exclude)
  chief = plan.chief
  info = dict(export.model_info(config, dataset),
              train_steps=controller.config.train_steps,
              **custom_inputs.record(train_input, eval_input),
              run_plan=record)
  # A relaunch keeps the record of the warm start its first launch did.
  init = init or (export.read_model_info_quietly(config.model_dir)
                  or {}).get("init_checkpoint")
  if init:
    info["init_checkpoint"] = init
  info.update(_config_changes(config.model_dir, controller, config,
                              split_change.change_entry(
                                  previous, record["model_parallel"],
                                  controller.step)))
  if chief:
    lock.record()
    # Written first, so a side-car evaluator can rebuild the model.
    export.write_model_info(config.model_dir, info)
  if prepare_controller is not None:
    prepare_controller(controller)
  controller.start_time = start_time
  # Raises NonFiniteLossError, before the weights file is (over)written,
  # when the last loop's loss was not finite.
  results = controller.run()
  if chief:
    if not isinstance(trainer, protocols.Exportable):
      logging.info("trainer=%s has no export_model(): the weights file and "
                   "the export hold its model", type(trainer).__name__)
    model = protocols.export_model(trainer)
    if protocols.ema_of(trainer) is not None:
      export.save_weights(model, os.path.join(config.model_dir,
                                              RAW_WEIGHTS_FILE))
    with protocols.averaged_weights(trainer):
      export.save_weights(model, os.path.join(config.model_dir, WEIGHTS_FILE))
      if config.export_saved_model:
        # This run's own config named the model: its code is trusted.
        export.export_saved_model(model, info, os.path.join(
            config.model_dir, export.EXPORT_DIR), trust_model_code=True)
  return results
