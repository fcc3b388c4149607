"""What the loop, the run and the self-check read of a trainer, written once.

Every attribute that `framework.core` (the Controller), `framework.app`
(`experiment.run`, export, evaluation) and `framework.check` read of a
trainer is declared here (`declared_names()`; a test runs a recording proxy
through a whole run). `LoopTrainer` is required (and `LoopEvaluator` to
evaluate); every other capability is optional, detected with `isinstance`
against its own protocol, and has the default written here when absent
(`framework.core.eval_batching` and `loop_report` read them once for the
Controller; `ps_training.CoordinatedTrainer` forwards exactly these names).
`framework.Trainer` implements all of them.

    class LoopTrainer(Protocol):          # required
      model: keras.Model                  # checkpointed
      optimizer: keras.optimizers.Optimizer  # checkpointed; its rate logged
      strategy: tf.distribute.Strategy
      global_step: tf.Variable            # int64, advanced by every step
      def train(self, iterator, num_steps: int) -> Mapping[str, Any]: ...
          # the mean of the steps that ran: any names, scalar values
      def sync_replica_state(self) -> None: ...  # before saves (may no-op)

    class LoopEvaluator(Protocol):        # needed with an eval_input
      def evaluate(self, distributed_dataset) -> Mapping[str, float]: ...

    # Optional (default when absent):
    BatchSized:     global_batch_size: int         # none: no batch check,
                                                   # no examples/s
    NanPolicy:      nan_policy: str                # "stop"
    SkipCounting:   max_skipped_steps, skipped_steps, consecutive_skips,
                    loss_scale                     # no skipped-step limit
    Stoppable:      request_stop(), stop_requested # no in-graph stop
    DatasetDistributing: distribute_dataset(ds)    # the strategy's
                                                   # experimental_distribute_dataset
    MaskedEvaluator: global_batch_size, run_eval_step(batch)
                                                   # eval batches as given
    MetricAliases:  metric_aliases                 # {}: `accuracy` is
                                                   # `accuracy`
    Exportable:     export_model()                 # the weights file and
                                                   # export save `model`
    LossScaled:     loss_scale                     # None: nothing extra
                                                   # checkpointed
    WeightAveraged: ema, averaged_weights()        # no EMA: one weights
                                                   # file, no swap
    ConfusionReporting: last_confusion             # evaluate.py: no matrix
    OptimizerCheckpointing: checkpointed_optimizer # `optimizer` itself
    Split:          unsplit_model                  # `model`: what a resume
                                                   # checks the architecture of
    TracksObjects:  tracked_objects                # {}: a trainer's extra
                                                   # models, optimizers, ...
                                                   # checkpointed by name

    # What the distribution self-check reads (framework/check):
    Steppable:      model, optimizer (swapped for a probe and back),
                    strategy, train_step(batch)    # required
    DistributedStep: distributed_train_step(dist_batch)
                                                   # strategy.run(train_step)
    LoopStep:       run_step(dist_batch), step_variables()
                                                   # the step above, its
                                                   # shares summed; model,
                                                   # optimizer, global_step
    GradientSettings: clip_norm, grad_accum_steps  # None, 1

The NaN policy watches `loss` when `train` returns one, else every value it
returns.
"""

import contextlib
from typing import Any, Mapping, Optional, Protocol, runtime_checkable

import keras
import tensorflow as tf

from framework import _tf_internal
from framework.errors import ConfigError


@runtime_checkable
class LoopTrainer(Protocol):
  """The trainer a `Controller` runs (required)."""

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
class BatchSized(Protocol):
  """Every training batch has `global_batch_size` examples (checked)."""

  global_batch_size: int


@runtime_checkable
class NanPolicy(Protocol):
  """`nan_policy`: "stop" (the default) raises NonFiniteLossError on a
  non-finite loop; "skip" lets the trainer skip such steps."""

  nan_policy: str


@runtime_checkable
class SkipCounting(Protocol):
  """Counts skipped updates (nan_policy=skip, float16 overflow); the run
  stops after `max_skipped_steps` in a row."""

  max_skipped_steps: int
  skipped_steps: tf.Variable
  consecutive_skips: tf.Variable
  loss_scale: Any  # None without float16 loss scaling


@runtime_checkable
class Stoppable(Protocol):
  """`request_stop()` ends a running `train` call at the next step;
  `stop_requested` (a bool variable) says it was asked, and the Controller
  clears it after the call and ends the run."""

  stop_requested: tf.Variable

  def request_stop(self) -> None:
    """Thread-safe: may be called while `train` runs."""


@runtime_checkable
class MaskedEvaluator(Protocol):
  """Evaluates padded batches (`framework.data.inputs.MaskedBatch`): the
  Controller re-batches a plain eval dataset to `global_batch_size` and
  pads its last batch, so that every replica gets a full batch."""

  global_batch_size: int

  def run_eval_step(self, batch: Any) -> Any:
    """One evaluation step on a (masked) batch."""


@runtime_checkable
class DatasetDistributing(Protocol):
  """Distributes datasets itself (e.g. a parameter-server coordinator)."""

  def distribute_dataset(self, dataset: tf.data.Dataset) -> Any:
    """`dataset` as the trainer's `train`/`evaluate` take it."""


@runtime_checkable
class MetricAliases(Protocol):
  """Names the evaluator reports a loop metric under: e.g. a segmentation
  evaluator's {"accuracy": "pixel_accuracy"} (`stop_at_accuracy`,
  `stop_when=eval/accuracy...` and the run record read that name)."""

  metric_aliases: Mapping[str, str]


@runtime_checkable
class Exportable(Protocol):
  """Gives the model that the weights file and the SavedModel hold (a split
  model reassembled). Optional: without it, `model` is saved."""

  def export_model(self) -> keras.Model:
    """The trained model as one plain Keras model."""


@runtime_checkable
class LossScaled(Protocol):
  """A float16 loss scale (`framework.core.precision.LossScale`, or None)
  whose state `experiment.run` checkpoints."""

  loss_scale: Any


@runtime_checkable
class WeightAveraged(Protocol):
  """An EMA of the weights (`framework.core.ema.WeightAverage`, or None):
  checkpointed, and the weights file holds the averaged weights."""

  ema: Any

  def averaged_weights(self) -> Any:
    """A context in which the model holds its averaged weights."""


@runtime_checkable
class TracksObjects(Protocol):
  """{name: trackable} a trainer checkpoints besides its model and
  optimizer (`Trainer.track`: a teacher, a discriminator, its optimizer)."""

  tracked_objects: Mapping[str, Any]


@runtime_checkable
class ConfusionReporting(Protocol):
  """`last_confusion`: the global confusion matrix of the last `evaluate`
  (numpy), or None."""

  last_confusion: Any


@runtime_checkable
class OptimizerCheckpointing(Protocol):
  """What checkpoints hold under `optimizer` when that is not `optimizer`
  itself (sharded optimizer state, saved whole under the same keys)."""
  checkpointed_optimizer: Any


@runtime_checkable
class Split(Protocol):
  """A model trained split (cut across devices): `unsplit_model` is the
  model it was cut from, whose layers (not the pieces', which differ from
  mesh to mesh) a resumed run must have (`export.model_fingerprint`)."""
  unsplit_model: keras.Model


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


@runtime_checkable
class DistributedStep(Protocol):
  """A step that is not `strategy.run(train_step)` (a model split with its
  own schedule): the per-replica outputs before their SUM."""

  def distributed_train_step(self, dist_batch: Any) -> Any:
    """One step on a distributed batch."""


@runtime_checkable
class LoopStep(Protocol):
  """The training loop's own step, which the self-check runs (a `Trainer`
  has it): one step as the loop runs it, and what a step changes."""

  def run_step(self, dist_batch: Any) -> Any:
    """(per-replica outputs, their SUM); advances `global_step`."""

  def step_variables(self) -> list:
    """Every variable one step may change."""


@runtime_checkable
class GradientSettings(Protocol):
  """Clipping and accumulation, which the self-check's diagnosis and its
  one-device batch order need (defaults None and 1)."""

  clip_norm: Any
  grad_accum_steps: int


OPTIONAL = (BatchSized, NanPolicy, SkipCounting, Stoppable, MaskedEvaluator,
            DatasetDistributing, MetricAliases, Exportable, LossScaled,
            WeightAveraged, ConfusionReporting, OptimizerCheckpointing,
            Split, DistributedStep, LoopStep, GradientSettings, TracksObjects)
ALL = (LoopTrainer, LoopEvaluator, Steppable) + OPTIONAL


def names_of(protocol: type) -> frozenset:
  """The attribute and method names `protocol` declares."""
  names = set(getattr(protocol, "__annotations__", {}))
  names.update(name for name, value in vars(protocol).items()
               if callable(value) and not name.startswith("_"))
  return frozenset(names)


def declared_names() -> frozenset:
  """Every name some protocol here declares: all that the loop, the run and
  the self-check may read of a trainer."""
  return frozenset().union(*(names_of(p) for p in ALL))


def missing(trainer: Any, protocol: type) -> list:
  """The names of `protocol` that `trainer` lacks, sorted."""
  return sorted(name for name in names_of(protocol)
                if not hasattr(trainer, name))


def loop_evaluator(trainer: Any, evaluator: Any, needed: bool) -> Any:
  """The evaluator a Controller uses (`evaluator`, else a `LoopEvaluator`
  trainer); ConfigError when `trainer` is no `LoopTrainer`, or when an
  evaluator is `needed` and there is none."""
  from framework.errors import ConfigError  # pylint: disable=g-import-not-at-top
  if not isinstance(trainer, LoopTrainer):
    raise ConfigError(
        f"trainer={type(trainer).__name__} lacks "
        f"{', '.join(missing(trainer, LoopTrainer))}: a Controller needs "
        "framework.core.protocols.LoopTrainer")
  if evaluator is None and isinstance(trainer, LoopEvaluator):
    evaluator = trainer
  if needed and not isinstance(evaluator, LoopEvaluator):
    raise ConfigError(
        f"an eval input is set but trainer={type(trainer).__name__} has no "
        "evaluate(distributed_dataset) and no evaluator= was given")
  return evaluator


def metric_aliases(evaluator: Any) -> dict:
  """{metric: the name `evaluator` reports it under} ({} unless it
  declares `MetricAliases`)."""
  if isinstance(evaluator, MetricAliases):
    return dict(evaluator.metric_aliases)
  return {}


def checkpoint_objects(trainer: Any,
                       extra: Optional[Mapping[str, Any]] = None) -> dict:
  """What a run's checkpoint holds: model, optimizer, global step, the
  model's random-generator state (a resumed run draws the same dropout
  masks) and `extra`."""
  objects = dict(model=trainer.model,
                 optimizer=checkpointed_optimizer(trainer),
                 global_step=trainer.global_step, **(extra or {}))
  rng_states = [v for v in trainer.model.variables
                if _tf_internal.is_seed_generator_state(v)]
  if rng_states:
    objects["rng_states"] = rng_states
  tracked = tracked_objects(trainer)
  for name, value in tracked.items():
    if name in objects or name == "rng_states":
      raise ConfigError(f"{type(trainer).__name__}.track({name}=...): "
                        f"{name!r} is a name the checkpoint already uses; "
                        "choose another")
  objects.update(tracked)
  return objects


def tracked_objects(trainer: Any) -> dict:
  """The trainer's `tracked_objects` ({} unless `TracksObjects`).

  Raises ConfigError, in one line, for a keras.Model or optimizer attribute
  of a trainer class of one's own that is neither its `model`/`optimizer`
  nor tracked: it would be left out of every checkpoint, so a resumed run
  would silently restart it.
  """
  tracked = dict(trainer.tracked_objects) if isinstance(
      trainer, TracksObjects) else {}
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
  """The model whose architecture a run records: `trainer.unsplit_model`
  if `Split`, else `trainer.model`."""
  if isinstance(trainer, Split):
    return trainer.unsplit_model
  return trainer.model


def export_model(trainer: Any) -> keras.Model:
  """The model to save: `trainer.export_model()` if `Exportable`, else
  `trainer.model`."""
  if isinstance(trainer, Exportable):
    return trainer.export_model()
  return trainer.model


def ema_of(trainer: Any) -> Any:
  """The trainer's weight EMA, or None."""
  return trainer.ema if isinstance(trainer, WeightAveraged) else None


def averaged_weights(trainer: Any) -> Any:
  """A context holding the EMA weights (a null context without an EMA)."""
  if ema_of(trainer) is None:
    return contextlib.nullcontext()
  return trainer.averaged_weights()


def checkpointed_optimizer(trainer: Any) -> Any:
  """What a checkpoint holds as `optimizer` (`trainer.optimizer` unless the
  trainer is `OptimizerCheckpointing`)."""
  if isinstance(trainer, OptimizerCheckpointing):
    return trainer.checkpointed_optimizer
  return trainer.optimizer


def loss_scale_of(trainer: Any) -> Any:
  """The trainer's float16 loss scale, or None."""
  return trainer.loss_scale if isinstance(trainer, LossScaled) else None


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
  """Whether `trainer.request_stop()` was called (`Stoppable`); clears it,
  so that the trainer's later calls run their steps again."""
  if not isinstance(trainer, Stoppable):
    return False
  if not bool(trainer.stop_requested.numpy()):
    return False
  trainer.stop_requested.assign(False)
  return True


def nan_policy(trainer: Any) -> str:
  """The trainer's NaN policy ("stop" unless it declares `NanPolicy`)."""
  return trainer.nan_policy if isinstance(trainer, NanPolicy) else "stop"


def watched_metrics(metrics: Mapping[str, Any]) -> dict:
  """The values the NaN policy watches: `loss` if present, else all."""
  if "loss" in metrics:
    return {"loss": metrics["loss"]}
  return dict(metrics)
