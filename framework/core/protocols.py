"""What the loop, the run and the self-check read of a trainer, written once.

Three protocols and one table; `declared_names()` is all of it (a test runs
a recording proxy through a whole run, and keeps docs/guide/python_api.md's
tables equal to these):

    class LoopTrainer(Protocol):          # what a Controller runs
      model: keras.Model                  # checkpointed
      optimizer: keras.optimizers.Optimizer  # checkpointed; its rate logged
      strategy: tf.distribute.Strategy
      global_step: tf.Variable            # int64, advanced by every step
      def train(self, iterator, num_steps: int) -> Mapping[str, Any]: ...
          # the mean of the steps that ran: any names, scalar values
      def sync_replica_state(self) -> None: ...  # before saves (may no-op)

    class LoopEvaluator(Protocol):        # needed with an eval input
      def evaluate(self, distributed_dataset) -> Mapping[str, float]: ...

    class Steppable(Protocol):            # the distribution self-check
      model, optimizer (swapped for a probe and back), strategy
      def train_step(self, batch) -> Mapping[str, Any]: ...

The Controller calls `train`, `sync_replica_state` and `evaluate` only; the
four attributes, and the `OPTIONAL` names below (each with its default
when a trainer lacks it, written once there), are read once into the
`LoopParts` it is handed (`loop_parts`), or by `framework.run`, the export
and the self-check through the readers at the end of this module.
`framework.Trainer` has them all; `ps_training.CoordinatedTrainer`
forwards them.
"""

import contextlib
import dataclasses
import functools
from typing import (Any, Callable, ContextManager, Mapping, Optional,
                    Protocol, runtime_checkable)

import keras
import tensorflow as tf

from framework import _tf_internal
from framework.core.config import TrainerConfig
from framework.settings import default


@runtime_checkable
class LoopTrainer(Protocol):
  """The trainer a `Controller` runs (required): it calls `train` and
  `sync_replica_state`; `loop_parts` reads the four attributes."""

  model: keras.Model
  optimizer: keras.optimizers.Optimizer
  strategy: tf.distribute.Strategy
  global_step: tf.Variable

  def train(self, iterator: Any, num_steps: int) -> Mapping[str, Any]:
    """Runs up to `num_steps` steps from `iterator`, advancing
    `global_step` by the number that ran; their mean metrics (scalars)."""

  def sync_replica_state(self) -> None:
    """Makes per-replica state consistent before it is read or saved."""


@runtime_checkable
class LoopEvaluator(Protocol):
  """What evaluates a model for the `Controller` (with an `eval_input`)."""

  def evaluate(self, distributed_dataset: Any) -> Mapping[str, float]:
    """Metrics over the whole dataset (a partial last batch included)."""


@runtime_checkable
class Steppable(Protocol):
  """What the distribution self-check runs: one `train_step` under the
  trainer's strategy, from its model's and optimizer's state (the check
  assigns a probe `optimizer` and puts the trainer's back)."""

  model: keras.Model
  optimizer: keras.optimizers.Optimizer
  strategy: tf.distribute.Strategy

  def train_step(self, batch: Any) -> Mapping[str, Any]:
    """One step on this replica's part of the batch: SUM-able shares."""


PROTOCOLS = (LoopTrainer, LoopEvaluator, Steppable)

# What else may be read of a trainer, each with its default when it lacks
# the name (`optional(trainer, name)`), and what reads it.
OPTIONAL = {
    # Training batches checked, examples/s; padded eval batches (with
    # run_eval_step).
    "global_batch_size": None,
    # "stop": a non-finite loop raises; "skip": the trainer skips the step.
    "nan_policy": "stop",
    # Skipped updates (nan_policy=skip, float16 overflow), counted; the run
    # stops after max_skipped_steps in a row.
    "max_skipped_steps": None,
    "skipped_steps": None,
    "consecutive_skips": None,
    # The float16 loss scale (checkpointed), or None.
    "loss_scale": None,
    # An in-graph stop: request_stop() ends a running `train` at the next
    # step; stop_requested (a bool variable) says it was asked.
    "request_stop": None,
    "stop_requested": None,
    # `dataset -> distributed`: default the strategy's
    # experimental_distribute_dataset (a parameter-server coordinator's own).
    "distribute_dataset": None,
    # One eval step on a padded batch (`MaskedBatch`): eval batches padded.
    "run_eval_step": None,
    # {metric: the name the evaluator reports it under}.
    "metric_aliases": {},
    # `() -> keras.Model` for the weights file and the export (a split model
    # reassembled); default `model`.
    "export_model": None,
    # The weight EMA (checkpointed; the weights file holds its averages) and
    # `averaged_weights()`, a context holding them.
    "ema": None,
    "averaged_weights": None,
    # evaluate.py's confusion matrix of the last `evaluate` (numpy).
    "last_confusion": None,
    # What checkpoints hold as `optimizer` (sharded slots saved whole).
    "checkpointed_optimizer": None,
    # The model a split trainer was cut from: what a resume checks the
    # architecture of; default `model`.
    "unsplit_model": None,
    # {name: trackable} a trainer checkpoints besides its model and
    # optimizer (`Trainer.track`: a teacher, a discriminator, its
    # optimizer).
    "tracked_objects": {},
    # The self-check: a step that is not strategy.run(train_step); the
    # loop's own step (run_step) and what it changes (step_variables);
    # clipping and accumulation (None, 1).
    "distributed_train_step": None,
    "run_step": None,
    "step_variables": None,
    "clip_norm": None,
    "grad_accum_steps": 1,
}


def optional(trainer: Any, name: str) -> Any:
  """`trainer.name`, or its `OPTIONAL` default."""
  return getattr(trainer, name, OPTIONAL[name])


def names_of(protocol: type) -> frozenset:
  """The attribute and method names `protocol` declares."""
  names = set(getattr(protocol, "__annotations__", {}))
  names.update(name for name, value in vars(protocol).items()
               if callable(value) and not name.startswith("_"))
  return frozenset(names)


def declared_names() -> frozenset:
  """Every name declared here: all that the loop, the run and the
  self-check may read of a trainer."""
  return frozenset(OPTIONAL).union(*(names_of(p) for p in PROTOCOLS))


def missing(trainer: Any, protocol: type) -> list:
  """The names of `protocol` that `trainer` lacks, sorted."""
  return sorted(name for name in names_of(protocol)
                if not hasattr(trainer, name))


def loop_evaluator(trainer: Any, evaluator: Any, needed: bool) -> Any:
  """The evaluator a Controller uses (`evaluator`, else a `LoopEvaluator`
  trainer); ConfigError when `trainer` has no `train` and
  `sync_replica_state`, or when an evaluator is `needed` and there is
  none."""
  from framework.errors import ConfigError  # pylint: disable=g-import-not-at-top
  lacks = [name for name in ("train", "sync_replica_state")
           if not callable(getattr(trainer, name, None))]
  if lacks:
    raise ConfigError(
        f"trainer={type(trainer).__name__} lacks {', '.join(lacks)}: a "
        "Controller needs framework.core.protocols.LoopTrainer")
  if evaluator is None and isinstance(trainer, LoopEvaluator):
    evaluator = trainer
  if needed and not isinstance(evaluator, LoopEvaluator):
    raise ConfigError(
        f"an eval input is set but trainer={type(trainer).__name__} has no "
        "evaluate(distributed_dataset) and no evaluator= was given")
  return evaluator


def metric_aliases(evaluator: Any) -> dict:
  """{metric: the name `evaluator` reports it under} ({} by default)."""
  return dict(optional(evaluator, "metric_aliases"))


def checkpoint_objects(trainer: Any,
                       extra: Optional[Mapping[str, Any]] = None) -> dict:
  """What a run's checkpoint holds: model, optimizer, global step, the
  model's random-generator state (a resumed run draws the same dropout
  masks), `extra` and the trainer's `tracked_objects`.

  Raises ConfigError, in one line, for a tracked name the checkpoint
  already uses.
  """
  from framework.errors import ConfigError  # pylint: disable=g-import-not-at-top
  objects = dict(model=trainer.model,
                 optimizer=checkpointed_optimizer(trainer),
                 global_step=trainer.global_step, **(extra or {}))
  rng_states = [v for v in trainer.model.variables
                if _tf_internal.is_seed_generator_state(v)]
  if rng_states:
    objects["rng_states"] = rng_states
  tracked = tracked_objects(trainer)
  for name in tracked:
    if name in objects or name == "rng_states":
      raise ConfigError(f"{type(trainer).__name__}.track({name}=...): "
                        f"{name!r} is a name the checkpoint already uses; "
                        "choose another")
  objects.update(tracked)
  return objects


def tracked_objects(trainer: Any) -> dict:
  """The trainer's `tracked_objects` ({} by default).

  Raises ConfigError, in one line, for a keras.Model or optimizer attribute
  of a trainer class of one's own that is neither its `model`/`optimizer`
  nor tracked: it would be left out of every checkpoint, so a resumed run
  would silently restart it.
  """
  from framework.errors import ConfigError  # pylint: disable=g-import-not-at-top
  tracked = dict(optional(trainer, "tracked_objects"))
  if type(trainer).__module__.startswith("framework."):
    return tracked  # the framework's own trainers declare theirs
  known = [trainer.model, trainer.optimizer, *tracked.values()]
  for name, value in sorted(vars(trainer).items()):
    if (isinstance(value, (keras.Model, keras.optimizers.Optimizer))
        and not any(value is k for k in known)):
      kind = ("keras.Model" if isinstance(value, keras.Model)
              else "optimizer")
      raise ConfigError(
          f"{type(trainer).__name__}.{name} (a {kind}) is not checkpointed: "
          f"create it in __init__ under `with self.strategy.scope():` and "
          f"register it with self.track({name}=self.{name})")
  return tracked


def unsplit_model(trainer: Any) -> keras.Model:
  """The model whose architecture a run records (`unsplit_model`, else
  `model`)."""
  model = optional(trainer, "unsplit_model")
  return trainer.model if model is None else model


def export_model(trainer: Any) -> keras.Model:
  """The model to save: `trainer.export_model()`, else `trainer.model`."""
  fn = optional(trainer, "export_model")
  return trainer.model if fn is None else fn()


def ema_of(trainer: Any) -> Any:
  """The trainer's weight EMA, or None."""
  return optional(trainer, "ema")


def averaged_weights(trainer: Any) -> Any:
  """A context holding the EMA weights (a null context without an EMA)."""
  if ema_of(trainer) is None:
    return contextlib.nullcontext()
  return trainer.averaged_weights()


def checkpointed_optimizer(trainer: Any) -> Any:
  """What a checkpoint holds as `optimizer` (`checkpointed_optimizer`, else
  `trainer.optimizer`)."""
  optimizer = optional(trainer, "checkpointed_optimizer")
  return trainer.optimizer if optimizer is None else optimizer


def loss_scale_of(trainer: Any) -> Any:
  """The trainer's float16 loss scale, or None."""
  return optional(trainer, "loss_scale")


def checkpoint_items(trainer: Any) -> dict:
  """What a run checkpoints besides model, optimizer and step: the loss
  scale's and the EMA's state, where the trainer has them."""
  items = {}
  loss_scale = loss_scale_of(trainer)
  if loss_scale is not None:
    items.update(loss_scale.checkpoint_items())
  ema = ema_of(trainer)
  if ema is not None:
    items.update(ema.checkpoint_items())
  return items


def take_stop_request(trainer: Any) -> bool:
  """Whether `trainer.request_stop()` was called; clears it, so that the
  trainer's later calls run their steps again."""
  return _take(optional(trainer, "stop_requested"))


def _take(requested):
  if requested is None or not bool(requested.numpy()):
    return False
  requested.assign(False)
  return True


def nan_policy(trainer: Any) -> str:
  """The trainer's NaN policy ("stop" by default)."""
  return optional(trainer, "nan_policy")


def watched_metrics(metrics: Mapping[str, Any]) -> dict:
  """The values the NaN policy watches: `loss` if present, else all."""
  if "loss" in metrics:
    return {"loss": metrics["loss"]}
  return dict(metrics)


@dataclasses.dataclass
class LoopParts:
  """What a `Controller` is handed besides the trainer it calls.

  The Controller calls the trainer through `train` and
  `sync_replica_state` (and the evaluator through `evaluate`) only; the
  rest it is handed here, each read once. `loop_parts(trainer)` fills them
  from a trainer that declares them (`framework.Trainer` does); a caller
  with its own trainer builds one:

      parts = LoopParts(global_step=step, strategy=strategy,
                        checkpoint={"model": model, "optimizer": optimizer,
                                    "global_step": step})

  Fields: `global_step` (int64, advanced by the trainer), `strategy`,
  `checkpoint` ({name: trackable}: what a checkpoint holds); the optimizer
  whose learning rate is logged (none: not logged); `global_batch_size`
  (training batches checked, examples/s; none: neither); `nan_policy`
  ("stop" raises on a non-finite loop; "skip": the trainer skips such
  steps); `skipped_steps` / `consecutive_skips` (`() -> int`) and
  `max_skipped_steps` (none: no skip count or limit); `request_stop()` (an
  in-graph stop, e.g. at SIGTERM) and `take_stop_request() -> bool` (the
  trainer asked to stop; cleared); `distribute_dataset` (default: the
  strategy's `experimental_distribute_dataset`); `eval_batch_size` (eval
  batches padded to it, `MaskedBatch`; none: as given); `metric_aliases`;
  `model` (best/ restores it; default `checkpoint["model"]`),
  `export_model()` (best/'s weights; default `model`), `ema` and
  `averaged_weights()` (a context holding the EMA weights).
  """

  global_step: Any
  strategy: Any
  checkpoint: Mapping[str, Any]
  optimizer: Any = None
  global_batch_size: Optional[int] = None
  nan_policy: str = default(TrainerConfig, "nan_policy")
  skipped_steps: Optional[Callable[[], int]] = None
  consecutive_skips: Optional[Callable[[], int]] = None
  max_skipped_steps: Optional[int] = None
  request_stop: Optional[Callable[[], None]] = None
  take_stop_request: Callable[[], bool] = lambda: False
  distribute_dataset: Optional[Callable[[Any], Any]] = None
  eval_batch_size: Optional[int] = None
  metric_aliases: Mapping[str, str] = dataclasses.field(default_factory=dict)
  model: Any = None
  export_model: Optional[Callable[[], Any]] = None
  ema: Any = None
  averaged_weights: Callable[[], ContextManager] = contextlib.nullcontext

  def __post_init__(self):
    self.checkpoint = dict(self.checkpoint)
    if self.model is None:
      self.model = self.checkpoint.get("model")
    if self.export_model is None:
      self.export_model = lambda: self.model
    if self.distribute_dataset is None:
      self.distribute_dataset = self.strategy.experimental_distribute_dataset


def loop_parts(trainer: Any, evaluator: Any = None,
               checkpoint_items: Optional[Mapping[str, Any]] = None
               ) -> LoopParts:
  """A `LoopTrainer`'s `LoopParts`, read once (each `OPTIONAL` name's
  default where it lacks one); `evaluator` (default: the trainer) gives
  the eval batch size and metric aliases; `checkpoint_items` join what the
  checkpoint holds. ConfigError when `trainer` is no `LoopTrainer`."""
  from framework.errors import ConfigError  # pylint: disable=g-import-not-at-top
  if not isinstance(trainer, LoopTrainer):
    raise ConfigError(
        f"trainer={type(trainer).__name__} lacks "
        f"{', '.join(missing(trainer, LoopTrainer))}: a Controller needs "
        "framework.core.protocols.LoopTrainer, or LoopParts handed to it")
  evaluator = trainer if evaluator is None else evaluator
  policy = nan_policy(trainer)
  skips = [optional(trainer, name) for name in
           ("skipped_steps", "consecutive_skips", "max_skipped_steps")]
  counts = all(value is not None for value in skips)
  skipped = consecutive = max_skipped = None
  if counts and (policy == "skip" or loss_scale_of(trainer) is not None):
    skipped = lambda: int(skips[0].numpy())
  if counts and policy == "skip":
    consecutive, max_skipped = lambda: int(skips[1].numpy()), skips[2]
  requested = optional(trainer, "stop_requested")
  masked = optional(evaluator, "run_eval_step") is not None
  return LoopParts(
      global_step=trainer.global_step, strategy=trainer.strategy,
      checkpoint=checkpoint_objects(trainer, checkpoint_items),
      optimizer=trainer.optimizer,
      global_batch_size=optional(trainer, "global_batch_size"),
      nan_policy=policy, skipped_steps=skipped, consecutive_skips=consecutive,
      max_skipped_steps=max_skipped,
      request_stop=(optional(trainer, "request_stop")
                    if requested is not None else None),
      take_stop_request=functools.partial(_take, requested),
      distribute_dataset=optional(trainer, "distribute_dataset"),
      eval_batch_size=(optional(evaluator, "global_batch_size") if masked
                       else None),
      metric_aliases=metric_aliases(evaluator),
      model=trainer.model,
      export_model=functools.partial(export_model, trainer),
      ema=ema_of(trainer),
      averaged_weights=functools.partial(averaged_weights, trainer))
