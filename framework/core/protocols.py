"""What the Controller needs from a trainer and an evaluator, written once.

`Controller` reads a trainer only through these protocols: `LoopTrainer` is
required; every other capability is optional, detected with `isinstance`
against its own protocol, and has the default written here when absent.
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

The NaN policy watches `loss` when `train` returns one, else every value it
returns.
"""

from typing import Any, Mapping, Protocol, runtime_checkable

import keras
import tensorflow as tf


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


def nan_policy(trainer: Any) -> str:
  """The trainer's NaN policy ("stop" unless it declares `NanPolicy`)."""
  return trainer.nan_policy if isinstance(trainer, NanPolicy) else "stop"


def watched_metrics(metrics: Mapping[str, Any]) -> dict:
  """The values the NaN policy watches: `loss` if present, else all."""
  if "loss" in metrics:
    return {"loss": metrics["loss"]}
  return dict(metrics)
