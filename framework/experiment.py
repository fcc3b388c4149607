"""One training run from a frozen config: what `scripts/train.py` calls.

Kept out of the script so that it can be imported, tested and reused by
other apps (a custom train step only needs `run(config, trainer_cls=...)`).
"""

import dataclasses
import os

from absl import logging
import keras
import tensorflow as tf

import models
from framework import (augment, datasets, distribution_check, export, inputs,
                       precision, segmentation, strategies)
from framework.controller import Controller, LoopConfig
from framework.errors import ConfigError, check_choice, check_positive
from framework.model_parallel.config import ModelParallelConfig
from framework.optimizers import OptimizerConfig, make_optimizer
from framework.trainer import Trainer

WEIGHTS_FILE = "model.weights.h5"


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
  """Everything a run needs; `scripts/train.py` fills it from flags.

  Exactly one of `train_steps` and `epochs` is set.
  """
  model: str = "cifar_cnn"
  dataset: str = "cifar10"
  data_dir: str = None
  model_dir: str = "/tmp/distloop"
  strategy: str = "default"
  tpu: str = None
  global_batch_size: int = 128
  train_steps: int = None
  epochs: int = None
  optimizer: OptimizerConfig = OptimizerConfig()
  clip_norm: float = None
  nan_policy: str = "stop"
  max_skipped_steps: int = 10
  loop: LoopConfig = None  # train_steps filled in by `resolve`
  seed: int = 0
  deterministic: bool = True
  input_mode: str = "global"
  grad_accum_steps: int = 1
  mixed_precision: str = "float32"
  augment: str = "none"
  model_options: dict = dataclasses.field(default_factory=dict)
  dataset_options: dict = dataclasses.field(default_factory=dict)
  export_saved_model: bool = True
  hparams: dict = dataclasses.field(default_factory=dict)
  check_distribution: bool = False
  model_parallel: ModelParallelConfig = ModelParallelConfig()

  def __post_init__(self):
    check_positive("global_batch_size", self.global_batch_size)
    if (self.train_steps is None) == (self.epochs is None):
      raise ConfigError("set exactly one of train_steps and epochs (got "
                        f"train_steps={self.train_steps}, "
                        f"epochs={self.epochs})")
    check_positive("train_steps" if self.epochs is None else "epochs",
                   self.train_steps if self.epochs is None else self.epochs)
    check_choice("input_mode", self.input_mode, inputs.INPUT_MODES)
    check_positive("grad_accum_steps", self.grad_accum_steps)
    check_positive("max_skipped_steps", self.max_skipped_steps)
    check_choice("mixed_precision", self.mixed_precision,
                 precision.PRECISIONS)
    check_choice("augment", self.augment, augment.AUGMENTATIONS)


def total_steps(config, num_train_examples):
  if config.train_steps is not None:
    return config.train_steps
  return config.epochs * inputs.steps_per_epoch(num_train_examples,
                                                config.global_batch_size)


def default_trainer_cls(dataset):
  """SegmentationTrainer for per-pixel labels, else the plain Trainer."""
  if segmentation.is_segmentation(dataset):
    return segmentation.SegmentationTrainer
  return Trainer


def build_model_and_optimizer(config, strategy, dataset):
  """(model, optimizer, LoopConfig with the run's length) under `strategy`."""
  steps = total_steps(config, len(dataset.train_x))
  loop = dataclasses.replace(config.loop or LoopConfig(train_steps=steps),
                             train_steps=steps)
  optimizer_config = config.optimizer
  if optimizer_config.schedule == "cosine" and not optimizer_config.total_steps:
    optimizer_config = dataclasses.replace(optimizer_config, total_steps=steps)
  keras.utils.set_random_seed(config.seed)
  # Layers keep the dtype policy they are built with; restore the global one.
  policy = keras.mixed_precision.global_policy()
  precision.set_precision(config.mixed_precision)
  try:
    with strategy.scope():
      model = models.build_model(config.model, dataset.input_shape,
                                 dataset.num_classes, **config.model_options)
      optimizer = make_optimizer(optimizer_config)
  finally:
    keras.mixed_precision.set_global_policy(policy)
  return model, optimizer, loop


def build(config, strategy, dataset, trainer_cls=None):
  """(trainer, controller) for `config` under `strategy` on `dataset`.

  Without `trainer_cls`, the dataset's task decides: per-pixel labels get a
  `SegmentationTrainer` (pixel accuracy, mean IoU) and mask summaries.
  """
  per_pixel = segmentation.is_segmentation(dataset)
  trainer_cls = trainer_cls or default_trainer_cls(dataset)
  model, optimizer, loop = build_model_and_optimizer(config, strategy,
                                                     dataset)
  # Only non-default options, so Trainer subclasses with their own
  # constructor keep working when they are not used.
  extra = {}
  if config.grad_accum_steps != 1:
    extra["grad_accum_steps"] = config.grad_accum_steps
  if config.max_skipped_steps != ExperimentConfig.max_skipped_steps:
    extra["max_skipped_steps"] = config.max_skipped_steps
  loss_scale = None
  if precision.needs_loss_scale(config.mixed_precision):
    loss_scale = precision.LossScale(strategy)
    extra["loss_scale"] = loss_scale
  trainer_cls = config.model_parallel.trainer_factory(trainer_cls)
  trainer = trainer_cls(model, optimizer, strategy,
                        global_batch_size=config.global_batch_size,
                        clip_norm=config.clip_norm,
                        nan_policy=config.nan_policy, **extra)
  augment_fn = augment.get_augmentation(config.augment)

  def train_input(start_step):
    return inputs.distribute_train(
        strategy, dataset, config.global_batch_size, seed=config.seed,
        start_step=start_step, augment=augment_fn,
        input_mode=config.input_mode)

  def eval_input():
    return inputs.distribute_eval(strategy, dataset.test_x, dataset.test_y,
                                  config.global_batch_size)

  kwargs = dict(train_input=train_input, eval_input=eval_input,
                hparams=config.hparams,
                checkpoint_items=(loss_scale.checkpoint_items()
                                  if loss_scale else None))
  if per_pixel:
    controller = segmentation.SegmentationController(
        trainer, loop, config.model_dir,
        samples=(dataset.test_x[:3], dataset.test_y[:3]), **kwargs)
  else:
    controller = Controller(trainer, loop, config.model_dir, **kwargs)
  return trainer, controller


def run(config, trainer_cls=None, strategy=None, prepare_controller=None):
  """Trains and evaluates per `config`; returns the final eval metrics.

  The chief also writes model_dir/model_info.json (before training), the
  final weights (model.weights.h5) and, if `export_saved_model`, a
  SavedModel (export/). `prepare_controller(controller)`, if given, runs
  before training starts (e.g. to add `on_loop_end` hooks such as
  preemption handling).
  """
  if config.deterministic:
    tf.config.experimental.enable_op_determinism()
  if strategy is None:
    strategy = strategies.make_strategy(config.strategy, tpu=config.tpu)
  replicas = strategy.num_replicas_in_sync
  if config.global_batch_size % replicas:
    raise ConfigError(
        f"global_batch_size={config.global_batch_size} is not divisible by "
        f"the {replicas} replicas of strategy={config.strategy}; use a "
        f"multiple of {replicas}")
  dataset = datasets.load_dataset(config.dataset, config.data_dir,
                                  seed=config.seed, **config.dataset_options)
  logging.info("strategy=%s replicas=%d dataset=%s train=%d test=%d",
               config.strategy, replicas, dataset.name, len(dataset.train_x),
               len(dataset.test_x))
  if config.check_distribution:
    # Before the real trainer exists; `build` re-seeds, so the run is the
    # same with or without the check.
    distribution_check.check_experiment(
        config, strategy, dataset, trainer_cls or default_trainer_cls(dataset))
  trainer, controller = build(config, strategy, dataset, trainer_cls)
  # Restore (or fail on a mismatched checkpoint) before writing anything.
  controller.restore()
  chief = strategies.is_chief(strategy)
  info = dict(export.model_info(config, dataset),
              train_steps=controller.config.train_steps)
  if chief:
    # Written first, so a side-car evaluator can rebuild the model.
    export.write_model_info(config.model_dir, info)
  if prepare_controller is not None:
    prepare_controller(controller)
  # Raises NonFiniteLossError, before the weights file is (over)written,
  # when the last loop's loss was not finite.
  results = controller.run()
  if chief:
    model = trainer.export_model()
    model.save_weights(os.path.join(config.model_dir, WEIGHTS_FILE))
    if config.export_saved_model:
      export.export_saved_model(model, info, os.path.join(
          config.model_dir, export.EXPORT_DIR))
  return results
