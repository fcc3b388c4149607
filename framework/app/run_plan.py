"""A run's plan: its config resolved once into what the layers below read.

`experiment.run` resolves the plan once, before the run lock: the compute
precision (`auto` made concrete), the strategy with its replicas and
devices, the model-parallel placement (a pipeline or tensor split under
`mirrored` becomes data x split), the dataset and its kind (what picks the
trainer, the controller and the model task check) and the eval plan (the
eval splits, the best checkpoint's metric). The factory, the self-check and
the Controller's construction read the plan instead of deciding again;
model_info.json records it under `run_plan`.
"""

import dataclasses
from typing import Any, Optional

from absl import logging

import models
from framework.app import custom_inputs
from framework.app import eval_set_specs
from framework.core import precision as precision_lib
from framework.core import ps_training
from framework.core.config import LoopConfig
from framework.data import datasets, inputs
from framework.distribute import strategies
from framework.errors import ConfigError
from framework.tasks import language_model

CLASSIFICATION = "classification"
SEGMENTATION = "segmentation"


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
  best_mode: str = "auto"
  stop_when: Optional[str] = None

  @classmethod
  def of(cls, config):
    loop = config.loop or LoopConfig(train_steps=1)
    return cls(splits=("eval",) + tuple(
        f"eval_{spec.name}"
        for spec in eval_set_specs.parse_all(config.eval_sets)),
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
    task: `classification`, `segmentation` or `language_model`.
    precision: the compute precision (`float32`, `bfloat16`, `float16`).
    replicas: `strategy.num_replicas_in_sync`.
    devices: the strategy's worker devices (() under the default one).
    chief: whether this process writes the run's files.
    parameter_server: whether a coordinator schedules the steps.
    eval: the `EvalPlan`.
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

  @classmethod
  def of(cls, config, strategy, dataset):
    """The plan of `config` under a made `strategy` on a loaded `dataset`
    (a concrete `mixed_precision` is taken as it is, `auto` resolved)."""
    compute = config.mixed_precision
    if compute not in precision_lib.PRECISIONS:
      compute = precision_lib.resolve_precision(compute)
      config = dataclasses.replace(config, mixed_precision=compute)
    return cls(config=config, strategy=strategy, dataset=dataset,
               task=language_model.task_name(dataset), precision=compute,
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


def _devices(strategy):
  """The strategy's worker devices; () where it places nothing itself (the
  default strategy: TensorFlow's own placement)."""
  try:
    return tuple(strategy.extended.worker_devices)
  except (RuntimeError, NotImplementedError):
    return ()


def place(config, strategy=None):
  """(config, strategy) of a run, before its data: the precision made
  concrete, the strategy made (unless given), the model split placed on
  it, the batch checked against its replicas. Touches no file."""
  # `auto` becomes what it means on this machine, once, before anything
  # reads the config (the check, model_info.json, the policy).
  config = dataclasses.replace(config, mixed_precision=(
      precision_lib.resolve_precision(config.mixed_precision)))
  if config.strategy == "parameter_server" or (
      strategy is not None and ps_training.is_parameter_server(strategy)):
    ps_training.check_config(config)
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
  replicas = strategy.num_replicas_in_sync
  if config.global_batch_size % replicas:
    raise ConfigError(
        f"global_batch_size={config.global_batch_size} is not divisible by "
        f"the {replicas} replicas of strategy={config.strategy}; use a "
        f"multiple of {replicas}")
  return config, strategy


def resolve(config, strategy=None, *, train_input=None, eval_input=None,
            placed=False):
  """The plan of a run of `config`: `place`s it (unless `placed`: `config`
  and `strategy` are what `place` returned) and loads its dataset; checks
  what needs them (a batch no larger than the data, the model's task).
  Touches no file of `config.model_dir`.

  Args:
    train_input, eval_input: a run's custom inputs (`experiment.run`).
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
  dataset = custom_inputs.fit_dataset(dataset, config.dataset, train_input,
                                      eval_input)
  if train_input is None:
    # Before anything is written: a batch larger than the data is no run.
    inputs.steps_per_epoch(dataset.num_train_examples,
                           config.global_batch_size)
  plan = RunPlan.of(config, strategy, dataset)
  # Before the distribution check, which builds the model too.
  models.check_task(config.model, plan.task, config.dataset)
  return plan
