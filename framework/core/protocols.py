"""What the loop, the run and the self-check read of a trainer, written once.

Three protocols (`LoopTrainer` required, `LoopEvaluator` with an eval
input, `Steppable` for the distribution self-check) and one table,
`OPTIONAL`: each other name that may be read, with its default when a
trainer lacks it. `declared_names()` is all of it: a test runs a recording
proxy through a whole run, and keeps docs/guide/python_api.md's tables
equal to these. The Controller calls `train`, `sync_replica_state` and
`evaluate` only; the rest is read once into the `LoopParts` it is handed
(`framework.core.controller.loop_parts`), or by `framework.run`, the
export and the self-check through `optional` and the readers below.
`framework.Trainer` has every name; `ps_training.CoordinatedTrainer`
forwards them.
"""

import contextlib
from typing import Any, Mapping, Protocol, runtime_checkable

import keras
import tensorflow as tf


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
    # A float64 variable: seconds this task waited in the gradient
    # all-reduce (each worker's step time split into compute and wait).
    "collective_wait_seconds": None,
    # `() -> keras.Model` for the weights file and the export (a split model
    # reassembled); default `model`.
    "export_model": None,
    # The weight EMA (checkpointed; the weights file holds its averages) and
    # `averaged_weights()`, a context holding them.
    "ema": None,
    "averaged_weights": None,
    # The loss-spike window and counts (`framework.core.spikes`;
    # checkpointed), or None: spike_policy=none.
    "spikes": None,
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


def unsplit_model(trainer: Any) -> keras.Model:
  """The model whose architecture a run records (`unsplit_model`, else
  `model`)."""
  model = optional(trainer, "unsplit_model")
  return trainer.model if model is None else model


def export_model(trainer: Any) -> keras.Model:
  """The model to save: `trainer.export_model()`, else `trainer.model`."""
  fn = optional(trainer, "export_model")
  return trainer.model if fn is None else fn()


def averaged_weights(trainer: Any) -> Any:
  """A context holding the EMA weights (a null context without an EMA)."""
  if optional(trainer, "ema") is None:
    return contextlib.nullcontext()
  return trainer.averaged_weights()


def checkpointed_optimizer(trainer: Any) -> Any:
  """What a checkpoint holds as `optimizer` (`checkpointed_optimizer`, else
  `trainer.optimizer`)."""
  optimizer = optional(trainer, "checkpointed_optimizer")
  return trainer.optimizer if optimizer is None else optimizer
