"""A run's plan: its config resolved once into what the layers below read.

`experiment.run` resolves the plan once (`place` before the run lock,
`resolve` under it): the compute precision (`auto` made concrete), the
strategy with its replicas and devices, the model-parallel placement (a
pipeline or tensor split under `mirrored` becomes data x split), the
dataset and its kind (what picks the trainer, the controller and the model
task check) and the eval plan (the eval splits, the best checkpoint's
metric). The factory, the self-check and the Controller's construction
read the plan instead of deciding again; model_info.json records it
under `run_plan`.

Custom inputs (`experiment.run(config, train_input=..., eval_input=...)`)
train on a user's own pipelines; `config.dataset` still gives the number
of classes, the class names and (without `train_input`) the epoch length,
and the model is built for the features `train_input` really gives (a
plain `tf.data.Dataset` tells its shape). Your own arrays need no custom
input at all: `dataset="numpy"` with `data_dir=` an `.npz` file is a
dataset like the others.
"""

import dataclasses
import functools
import os
from typing import Any, Optional

from absl import logging
import tensorflow as tf

import models
from models import registry
from framework.app import config as app_config
from framework.app import export
# A resume on another model split is decided in `resume`; its names here
# keep working.
from framework.app.resume import (  # pylint: disable=unused-import
    MIGRATE_SCRIPT, _own_keys, _show, change_entry, changed_flags,
    check_async_checkpoint, check_resume, check_split_change, describe,
    saved_before_cross_mesh, split_flags)
from framework.core.checkpoints import manager
from framework.core import precision as precision_lib
from framework.core import ps_training
from framework.core.config import LoopConfig
from framework.data import datasets, inputs, preprocessing
from framework.data.inputs import MaskedBatch
from framework.distribute import strategies
from framework.errors import ConfigError
from framework.settings import default
from framework.tasks import language_model

CLASSIFICATION = "classification"
SEGMENTATION = "segmentation"
CUSTOM = registry.CUSTOM


@dataclasses.dataclass(frozen=True)
class EvalPlan:
  """What a run evaluates and keeps.

  Attributes:
    splits: the eval splits, `eval` first, then `eval_<NAME>` per eval set.
    best_metric: `SPLIT/METRIC` the best checkpoint follows (None: off).
    best_mode: `max`, `min` or `auto`.
    stop_when: the early-stopping condition (None: off).
  """
  splits: tuple[str, ...] = ("eval",)
  best_metric: Optional[str] = None
  best_mode: str = default(LoopConfig, "best_mode")
  stop_when: Optional[str] = None

  @classmethod
  def of(cls, config):
    loop = config.loop or LoopConfig(train_steps=1)
    return cls(splits=("eval",) + tuple(
        f"eval_{spec.name}"
        for spec in app_config.parse_all(config.eval_sets)),
               best_metric=loop.best_metric, best_mode=loop.best_mode,
               stop_when=loop.stop_when)


@dataclasses.dataclass(frozen=True)
class RunPlan:
  """A run of `config`, resolved (build one with `resolve` or `of`).

  Attributes:
    config: the run's config, `mixed_precision` concrete and
      `model_parallel` placed on this process's devices.
    strategy: the strategy the run trains under (after a data x split).
    dataset: the run's dataset (custom inputs' shape fitted in).
    task: `classification`, `segmentation`, `language_model` or `custom`
      (the trainer's `task`: its `compute_loss` is the task).
    precision: the compute precision (`float32`, `bfloat16`, `float16`).
    replicas: `strategy.num_replicas_in_sync`.
    devices: the strategy's worker devices (() under the default one).
    chief: whether this process writes the run's files.
    parameter_server: whether a coordinator schedules the steps.
    eval: the `EvalPlan`.
    scaled_pixels: whether the model's inputs are uint8 images divided by
      255 (None: not known), which decides whether a model that expects
      0-255 pixels gets its input times 255 (`models.input_scale`); a
      resumed run's record decides over the data (`with_recorded_scale`).
    scaled_pixels_why: what decided `scaled_pixels`, for the log line.
  """
  config: Any
  strategy: Any = dataclasses.field(repr=False, compare=False)
  dataset: Any = dataclasses.field(repr=False, compare=False)
  task: str
  precision: str
  replicas: int
  devices: tuple[str, ...]
  chief: bool
  parameter_server: bool
  eval: EvalPlan
  scaled_pixels: Optional[bool] = None
  scaled_pixels_why: Optional[str] = None

  @classmethod
  def of(cls, config, strategy, dataset, train_data=None, trainer_cls=None):
    """The plan of a `place`d `config` (its `mixed_precision` concrete)
    under a made `strategy` on a loaded `dataset` (`train_data`: the
    first dataset a custom `train_input` gives; `trainer_cls`: the run's,
    whose `task` decides over the dataset's)."""
    scaled, why = preprocessing.scaled_pixels(dataset, train_data)
    return cls(config=config, strategy=strategy, dataset=dataset,
               scaled_pixels=scaled, scaled_pixels_why=why,
               task=task_of(config, dataset, trainer_cls),
               precision=config.mixed_precision,
               replicas=strategy.num_replicas_in_sync,
               devices=_devices(strategy),
               chief=strategies.is_chief(strategy),
               parameter_server=ps_training.is_parameter_server(strategy),
               eval=EvalPlan.of(config))

  @property
  def is_segmentation(self):
    """One label per pixel: segmentation trainer, controller and masks."""
    return self.task == SEGMENTATION

  @property
  def is_language_model(self):
    return self.task == language_model.TASK

  @property
  def model_parallel(self):
    """The placed `ModelParallelConfig` (mode, stages/shards, groups)."""
    return self.config.model_parallel

  def record(self):
    """The plan as JSON (model_info.json's `run_plan`)."""
    split = self.model_parallel
    return {"task": self.task, "precision": self.precision,
            "strategy": self.config.strategy, "replicas": self.replicas,
            "devices": list(self.devices), "chief": self.chief,
            "parameter_server": self.parameter_server,
            "model_parallel": {
                "mode": split.mode, "mesh": split.mesh,
                "num_stages": split.num_stages,
                "num_shards": split.num_shards,
                "tensor_stages": split.tensor_stages,
                "replica_devices": [list(g) for g in split.replica_devices]},
            "eval": dict(dataclasses.asdict(self.eval),
                         splits=list(self.eval.splits))}


def trainer_task(trainer_cls):
  """The `task` a trainer class (or a `functools.partial` of one)
  declares; None: the dataset's."""
  while isinstance(trainer_cls, functools.partial):
    trainer_cls = trainer_cls.func
  return getattr(trainer_cls, "task", None)


def task_of(config, dataset, trainer_cls=None):
  """The run's task: `custom` if its trainer declares it, else the
  dataset's; ConfigError for data without class labels (unlabeled, or
  float targets) unless the trainer's task is `custom`."""
  if trainer_task(trainer_cls) == CUSTOM:
    return CUSTOM
  where = f" at {config.data_dir}" if config.data_dir else ""
  if not getattr(dataset, "has_labels", True):
    raise ConfigError(
        f"dataset={config.dataset}{where} has no labels (no y_train, "
        f"y_test), which model={config.model!r} as a classifier needs: "
        f"{registry.CUSTOM_HINT}")
  if not getattr(dataset, "has_classes", True):
    raise ConfigError(
        f"dataset={config.dataset}{where}: y_train holds float targets "
        f"({dataset.train_y.dtype}), not class indices, which "
        f"model={config.model!r} as a classifier needs: "
        f"{registry.CUSTOM_HINT}")
  return language_model.task_name(dataset)


def _devices(strategy):
  """The strategy's worker devices; () where it places nothing itself (the
  default strategy: TensorFlow's own placement)."""
  try:
    return tuple(strategy.extended.worker_devices)
  except (RuntimeError, NotImplementedError):
    return ()


def named_model(config, build_model):
  """`config` naming `build_model` by its import path (or, without one,
  `config.model` checked against the registry before any work)."""
  if build_model is None:
    # A bad --model (or weights file) fails before any work; a resume
    # needs no initial weights file (its checkpoint holds every weight).
    registry.check_model(config.model, config.model_options,
                         resuming=manager.has_checkpoint(config.model_dir))
    return config
  path = registry.import_path_of(build_model)
  if path is not None:
    registry.check_import_path(path)
  if path is None:
    raise ConfigError(
        f"build_model={build_model!r} must be a module-level function "
        "(model_info.json records it as module:function so that "
        "evaluate.py, predict.py and the export rebuild it)")
  _warn_if_main(path)
  return dataclasses.replace(config, model=path)


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


def place(config, strategy=None):
  """(config, strategy) of a run, before its data: the precision made
  concrete, the strategy made (unless given), the model split placed on
  it. Touches no file. (The batch is checked against the replicas once,
  by the Trainer it is given to.)"""
  # `auto` becomes what it means on this machine, once, before anything
  # reads the config (the check, model_info.json, the policy).
  config = dataclasses.replace(config, mixed_precision=(
      precision_lib.resolve_precision(config.mixed_precision)))
  if config.strategy == "parameter_server" or (
      strategy is not None and ps_training.is_parameter_server(strategy)):
    ps_training.check_config(config)
  check_async_checkpoint(config)
  if strategy is None:
    strategy = strategies.make_strategy(config.strategy, tpu=config.tpu)
  # A pipeline under mirrored: R copies of it, on one replica.
  model_parallel, strategy = config.model_parallel.with_strategy(
      strategy, config.strategy)
  if model_parallel.replica_devices:
    config = dataclasses.replace(config, model_parallel=model_parallel)
    piece = ("stage pipeline" if model_parallel.mode == "pipeline"
             else "way tensor split")
    logging.info("data x %s: %d copies of a %d-%s on %s",
                 model_parallel.mode, len(model_parallel.replica_devices),
                 model_parallel.device_count[0], piece,
                 model_parallel.replica_devices)
  return config, strategy


def resolve(config, strategy=None, *, train_input=None, eval_input=None,
            placed=False, trainer_cls=None):
  """The plan of a run of `config`: `place`s it (unless `placed`: `config`
  and `strategy` are what `place` returned) and loads its dataset; checks
  what needs them (a batch no larger than the data, the model's task).
  Touches no file of `config.model_dir`.

  Args:
    train_input, eval_input: a run's custom inputs (`experiment.run`).
    trainer_cls: the run's trainer class, whose `task` decides over the
      dataset's (`task_of`).
  """
  if not placed:
    config, strategy = place(config, strategy)
  replicas = strategy.num_replicas_in_sync
  logging.info("loading dataset=%s%s", config.dataset,
               f" from {config.data_dir}" if config.data_dir else "")
  dataset = datasets.load_dataset(config.dataset, config.data_dir,
                                  seed=config.seed, **config.dataset_options)
  logging.info("strategy=%s replicas=%d dataset=%s train=%d test=%d",
               config.strategy, replicas, dataset.name,
               dataset.num_train_examples, dataset.num_test_examples)
  # Custom inputs: the model is built for the features they give.
  train_data = train_input(0) if train_input is not None else None
  dataset = fit_dataset(dataset, config.dataset, train_data, eval_input)
  if train_input is None:
    # Before anything is written: a batch larger than the data is no run.
    inputs.steps_per_epoch(dataset.num_train_examples,
                           config.global_batch_size)
  shape = tuple(dataset.input_shape or ())
  if config.augment != "none" and train_input is None and len(shape) != 3:
    # The flips and crops act on [height, width, channels] images.
    raise ConfigError(
        f"augment={config.augment} flips and crops images [height, width, "
        f"channels], but dataset={config.dataset} has features of shape "
        f"{list(shape)}; use augment=none")
  plan = RunPlan.of(config, strategy, dataset, train_data, trainer_cls)
  # Before the distribution check, which builds the model too (a model
  # registered without its task: `factory` checks it once built).
  models.check_task(config.model, plan.task, config.dataset,
                    label_shape=getattr(dataset, "label_shape", None))
  return plan


def with_recorded_scale(plan, previous_info):
  """`plan` with the input scale that `previous_info` (the model_dir's
  model_info.json, None: a new run) records: a resumed run is built as it
  was trained (`export.recorded_scale`)."""
  if previous_info is None:
    return plan
  scale = export.recorded_scale(previous_info)
  return dataclasses.replace(plan, scaled_pixels=scale["scaled_pixels"],
                             scaled_pixels_why=scale["why"])


def features_shape(data):
  """The per-example shape of `data`'s features (a plain `tf.data.Dataset`
  of `(features, labels)` batches), or None where it cannot tell (another
  kind of input, a dynamic shape, nested features)."""
  if not isinstance(data, tf.data.Dataset):
    return None
  spec = data.element_spec
  if isinstance(spec, MaskedBatch):
    spec = spec.batch
  if isinstance(spec, tuple) and len(spec) >= 2:
    spec = spec[0]
  if not isinstance(spec, tf.TensorSpec) or spec.shape.rank in (None, 0):
    return None
  shape = tuple(spec.shape[1:])
  return None if any(d is None for d in shape) else shape


class _WithInputShape:
  """`dataset` with another `input_shape` (everything else its own)."""

  def __init__(self, dataset, input_shape):
    self._dataset = dataset
    self.input_shape = tuple(input_shape)

  def __getattr__(self, name):
    return getattr(self._dataset, name)


def fit_dataset(dataset, dataset_name, train_data, eval_input):
  """`dataset`, with the input shape of `train_data` (what a custom
  `train_input(0)` gives; None: no custom input) if that differs.

  Raises ConfigError when the shapes differ and there is no `eval_input`:
  the run would evaluate on `dataset`'s test split, of the other shape.
  """
  if train_data is None:
    return dataset
  shape = features_shape(train_data)
  if shape is None or shape == tuple(dataset.input_shape):
    return dataset
  if eval_input is None:
    raise ConfigError(
        f"train_input gives features of shape {shape}, but "
        f"dataset={dataset_name} has {tuple(dataset.input_shape)} and, with "
        "no eval_input, the run would evaluate on its test split: pass "
        "eval_input= too, or put your arrays in an .npz and use "
        "dataset='numpy', data_dir=<file> (no custom inputs needed)")
  logging.info("train_input gives features of shape %s: the model is built "
               "for it (dataset=%s has %s)", shape, dataset_name,
               tuple(dataset.input_shape))
  return _WithInputShape(dataset, shape)
