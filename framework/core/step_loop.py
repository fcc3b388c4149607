"""The in-graph step loop of a Trainer: `steps_per_loop` steps per call.

    train(iterator, n):                 # one tf.function call
      metrics = one step                # always, so the mean is never 0 / 0
      while steps < n and keep_going:   # keep_going: no stop requested and,
        metrics += one step             # under nan_policy=skip, fewer than
                                        # max_skipped_steps skips in a row
      return metrics / steps            # global_step counts what ran

    one step = run_step(next(iterator)):  SUM over replicas of
               distributed_train_step(batch); global_step += 1

Python is not on the per-step path. `StepLoop` is a mixin of
`framework.Trainer`; it reads the trainer's `strategy`, `global_step`,
`stop_requested`, `nan_policy`, the skip counters, `ema`, `loss_scale`,
`model`, `optimizer` and `train_step`.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from framework.core import summaries, xla
from framework.errors import ConfigError

SUM = tf.distribute.ReduceOp.SUM


class StepLoop:
  """`train(iterator, num_steps)` over the trainer's `train_step`."""

  # The compiled replica step under jit_compile (framework/core/xla.py).
  _replica_step = None
  jit_compile = None

  def _reduce(self, per_replica):
    return {k: self.strategy.reduce(SUM, v, axis=None)
            for k, v in per_replica.items()}

  def distributed_train_step(self, dist_batch: Any) -> dict[str, Any]:
    """`train_step` on every replica's part of `dist_batch`: the per-replica
    outputs, before their SUM (what the loop and the distribution check
    both run)."""
    step = self._replica_step or self.train_step  # XLA-compiled or not
    return self.strategy.run(step, args=(dist_batch,))

  def run_step(self, dist_batch: Any) -> tuple[Any, dict[str, Any]]:
    """One training step on a distributed batch, as the loop runs it.

    Advances `global_step`. The distribution check calls it too, so that it
    checks the loop's own step rather than a copy.

    Returns:
      (the per-replica outputs of `distributed_train_step`, their SUM over
      replicas: the step's metrics).
    """
    self._applied_in_trace = False
    # tf.summary calls inside the step record at the step it ends at (the
    # Controller's train/ scalars use the same numbering).
    with summaries.default_step(self.global_step + 1):
      per_replica = self.distributed_train_step(dist_batch)
    if not self._applied_in_trace and (self.ema is not None
                                       or self.nan_policy == "skip"):
      # Raised by `train` once traced (autograph would re-wrap it here).
      feature = ("ema_decay (the EMA of the weights)" if self.ema is not None
                 else "nan_policy=skip")
      self._trace_error = (
          f"{feature}: {type(self).__name__}.train_step never calls "
          "self.apply_gradients, which does it; call it for the update or "
          "override compute_loss instead")
    metrics = self._reduce(per_replica)
    self.global_step.assign_add(1)
    return per_replica, metrics

  def step_variables(self) -> list[Any]:
    """Every variable one step may change: the model's, the optimizer's,
    the EMA's, the float16 loss scale's, the skip counters and
    `global_step` (what the distribution check puts back afterwards)."""
    state = list(self.model.variables) + list(self.optimizer.variables)
    if self.ema is not None:
      state += list(self.ema.averages) + [self.ema.num_updates]
    if self.loss_scale is not None:
      state += [self.loss_scale.scale, self.loss_scale.good_steps]
    return state + [self.skipped_steps, self.consecutive_skips,
                    self.global_step]

  def _one_step(self, iterator):
    return self.run_step(next(iterator))[1]

  def _keep_going(self):
    """Whether the loop may run another step (read before each step)."""
    keep_going = tf.logical_not(self.stop_requested)
    if self.nan_policy == "skip":
      keep_going = tf.logical_and(
          keep_going, self.consecutive_skips < self.max_skipped_steps)
    return keep_going

  def _train_loop_fn(self, iterator, num_steps):
    # The first step always runs, so that the metrics are never 0 / 0.
    totals = self._one_step(iterator)
    steps = tf.constant(1)
    while tf.logical_and(steps < num_steps, self._keep_going()):
      step_metrics = self._one_step(iterator)
      totals = {k: totals[k] + step_metrics[k] for k in totals}
      steps += 1
    return {k: v / tf.cast(steps, v.dtype) for k, v in totals.items()}

  def train(self, iterator: Any, num_steps: int) -> dict[str, Any]:
    """Runs `num_steps` steps in one graph call; returns their mean metrics.

    Fewer steps run when a stop was requested or, under `nan_policy=skip`,
    `max_skipped_steps` steps in a row were skipped: `global_step` tells how
    many ran.
    """
    num_steps = tf.constant(num_steps, tf.int32)
    # Traced before it runs, so that a step that would drop a feature
    # fails before it trains (the call reuses this trace).
    self._train_loop.get_concrete_function(iterator, num_steps)
    if self._trace_error:
      raise ConfigError(self._trace_error)
    if not self.jit_compile:
      return self._train_loop(iterator, num_steps)
    try:  # XLA compiles at the first call
      return self._train_loop(iterator, num_steps)
    except (tf.errors.InvalidArgumentError, tf.errors.UnimplementedError) as e:
      line = xla.compile_error(e)
      if line is None:
        raise
      raise ConfigError(line) from None

