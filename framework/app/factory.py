"""One place that builds a run's model, optimizer and trainer from its config.

The run (`experiment.build`) and its self-check (`check_run`, i.e.
`--check_distribution`) both build through `build_trainer`, so the check
checks the trainer that trains: the same schedule length, label smoothing,
gradient accumulation, float16 loss scale, EMA and NaN policy.
"""

import dataclasses

from absl import logging
import keras

import models
from models import registry
from framework.core import optimizers, precision
from framework.core import trainer as losses
from framework.core.config import TrainerConfig
from framework.core.controller import LoopConfig
from framework.core.trainer import Trainer
from framework.data import inputs
from framework.errors import ConfigError
from framework.tasks import language_model, segmentation

def total_steps(config, num_train_examples):
  """The run's length in steps (`train_steps`, or `epochs` in steps)."""
  if config.train_steps is not None:
    return config.train_steps
  return config.epochs * inputs.steps_per_epoch(num_train_examples,
                                                config.global_batch_size)


def default_trainer_cls(dataset=None, *, task=None):
  """SegmentationTrainer for per-pixel labels, LanguageModelTrainer for
  token sequences, else the plain Trainer (`task`: the dataset's, as
  `language_model.task_name` or a `RunPlan` gives it)."""
  task = task or language_model.task_name(dataset)
  if task == language_model.TASK:
    return language_model.LanguageModelTrainer
  if task == "segmentation":
    return segmentation.SegmentationTrainer
  return Trainer


def optimizer_config(config, steps):
  """`config.optimizer` for a run of `steps` steps: a decaying schedule
  (cosine, linear, onecycle) without `total_steps` gets the run's length,
  and `lr_scaling` is applied to the learning rate."""
  result = config.optimizer
  if (result.schedule in optimizers.DECAYING_SCHEDULES
      and not result.total_steps):
    result = dataclasses.replace(result, total_steps=steps)
  if result.lr_scaling != "none":
    scaled = result.scaled(config.global_batch_size)
    logging.info("lr_scaling=%s: learning_rate %g for batch %d -> %g for "
                 "batch %d", result.lr_scaling, result.learning_rate,
                 result.base_batch_size, scaled.learning_rate,
                 config.global_batch_size)
    result = scaled
  return result


def build_model_and_optimizer(config, strategy, dataset, build_model=None, *,
                              compute_precision=None, task=None):
  """(model, optimizer, LoopConfig with the run's length) under `strategy`.

  `build_model(input_shape, num_classes, **options)` builds the model
  (default: the builder `config.model` names). `compute_precision` replaces
  `config.mixed_precision` for the model's dtype policy (None: the run's).
  `task`: the dataset's (None: from `dataset`).
  """
  steps = total_steps(config, dataset.num_train_examples)
  loop = dataclasses.replace(config.loop or LoopConfig(train_steps=steps),
                             train_steps=steps)
  if loop.profile_steps and loop.profile_steps[0] > steps:
    raise ConfigError(
        f"profile_steps={loop.profile_steps} starts after the run's last "
        f"step (train_steps={steps}): nothing would be traced; choose steps "
        f"in 1..{steps}")
  optimizer_cfg = optimizer_config(config, steps)
  keras.utils.set_random_seed(config.seed)
  # Layers keep the dtype policy they are built with; restore the global one.
  policy = keras.mixed_precision.global_policy()
  precision.set_precision(compute_precision or config.mixed_precision)
  try:
    with strategy.scope():
      try:
        if build_model is None:
          model = models.build_model(config.model, dataset.input_shape,
                                     dataset.num_classes,
                                     **config.model_options)
        else:
          model = registry.call_builder(build_model, dataset.input_shape,
                                        dataset.num_classes,
                                        config.model_options,
                                        name=config.model)
      except ConfigError:
        raise  # the builder's own check, already one line
      except ValueError as e:
        # Keras's long input-compatibility error: one line, before any work.
        raise ConfigError(
            f"model={config.model} cannot be built for the inputs of "
            f"dataset={config.dataset}, of shape "
            f"{tuple(dataset.input_shape)} ("
            f"{str(e).strip().splitlines()[0][:300]})") from None
      registry.check_outputs(config.model, model, dataset.num_classes,
                             config.dataset)
      # A model registered without its task is known once built.
      models.check_task(config.model,
                        task or language_model.task_name(dataset),
                        config.dataset, model)
      optimizer = optimizers.make_optimizer(optimizer_cfg)
  finally:
    keras.mixed_precision.set_global_policy(policy)
  return model, optimizer, loop


def trainer_options(config, strategy):
  """The Trainer keyword arguments of a run of `config` under `strategy`:
  every step setting (`TrainerConfig`'s fields), whatever its value (a
  float16 run also gets a new `LossScale` for that strategy)."""
  step = TrainerConfig.of(config)
  if step.jit_compile and config.model_parallel.mode != "none":
    logging.warning("jit_compile: not supported with model_parallel=%s (a "
                    "stage's ops run on several devices, an XLA function on "
                    "one); training without XLA", config.model_parallel.mode)
    step = dataclasses.replace(step, jit_compile=False)
  options = dict(global_batch_size=config.global_batch_size,
                 **{f.name: getattr(step, f.name)
                    for f in dataclasses.fields(step)})
  if config.label_smoothing:
    options["loss_fn"] = losses.smoothed_sparse_categorical_loss(
        config.label_smoothing)
  if precision.needs_loss_scale(config.mixed_precision):
    options["loss_scale"] = precision.LossScale(strategy)
  return options


def build_trainer(config, strategy, dataset, trainer_cls=None, *,
                  build_model=None, make_trainer=None, model_parallel=True,
                  compute_precision=None, plan=None):
  """(trainer, LoopConfig) of a run of `config` under `strategy`.

  Args:
    trainer_cls: default: the dataset's task decides (`default_trainer_cls`).
    build_model: as for `experiment.run` (default: `config.model`).
    make_trainer: `(model, optimizer, strategy, **trainer_options) ->
      trainer`, replacing `trainer_cls` and the model split.
    model_parallel: bind `trainer_cls` to `config.model_parallel`'s split
      (False: the unsplit trainer, the self-check's reference).
    compute_precision: the model's dtype policy instead of the run's (the
      float16 loss scale still follows `config.mixed_precision`).
    plan: the run's `RunPlan`, whose dataset task is read instead of
      deciding it again.
  """
  task = plan.task if plan is not None else None
  trainer_cls = trainer_cls or default_trainer_cls(dataset, task=task)
  model, optimizer, loop = build_model_and_optimizer(
      config, strategy, dataset, build_model,
      compute_precision=compute_precision, task=task)
  if make_trainer is None:
    make_trainer = (config.model_parallel.trainer_factory(trainer_cls)
                    if model_parallel else trainer_cls)
  trainer = make_trainer(model, optimizer, strategy,
                         **trainer_options(config, strategy))
  return trainer, loop
