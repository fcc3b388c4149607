"""Actions: `fn(step, outputs)` called by the Controller after each loop.

A train action gets the loop's outputs (the trainer's mean metrics plus
`learning_rate`, `steps_per_second`, ...), after they were logged and
summarised and before the loop's checkpoint and evaluation; an eval action
gets each evaluation's results. An action may raise (the run ends there,
saving nothing more) or call `controller.request_stop(reason)`: the run
then ends after this loop's checkpoint and evaluation as at `train_steps`
(final checkpoint, evaluation, and with `experiment.run` the weights file
and the export).

Built in: the NaN policy (`NanGuard`), early stopping (`StopWhen`, from
`LoopConfig.stop_when` / `stop_at_accuracy`), the profiler's report,
preemption (`framework.core.preemption.install`) and the segmentation mask
summaries.
"""

import time
from typing import Any, Callable, Mapping, Optional

from absl import logging

from framework.core import eval_sets
from framework.core import protocols
from framework.core.stop_condition import StopCondition
from framework.errors import NonFiniteLossError

Action = Callable[[int, Mapping[str, float]], Any]

class StopWhen:
  """Stops the run the first time `condition` holds; records the time it
  took (`time_to_target_seconds` under the condition's split).

  Args:
    controller: the Controller to stop (its `start_time`, writers and
      `time_to_target` are used).
    condition: a `StopCondition`.
    description: how the log names the target (default: the condition).
  """

  def __init__(self, controller: Any, condition: StopCondition,
               description: Optional[str] = None):
    self.controller = controller
    self.condition = condition
    self.description = description

  def __call__(self, step: int, outputs: Mapping[str, float]) -> None:
    c = self.controller
    if self.condition.split != "train":
      outputs = eval_sets.results_of(c, self.condition.split, outputs)
    if (c.time_to_target is not None or not c.measure_target
        or not self.condition.met(outputs)):
      return
    c.time_to_target = time.time() - (c.start_time or time.time())
    c.writer(self.condition.split).scalars(
        step, {"time_to_target_seconds": c.time_to_target})
    value = self.condition.metric_value(outputs)
    if self.description:
      logging.info("target %s reached at step %d: %s=%.4f "
                   "time_to_target_seconds=%.1f", self.description, step,
                   self.condition.metric, value, c.time_to_target)
    else:
      logging.info("target %s reached at step %d: %s=%.4f "
                   "time_to_target_seconds=%.1f", self.condition, step,
                   self.condition.metric, value, c.time_to_target)
    c.request_stop(f"stop_when {self.condition}")


class NanGuard:
  """The NaN policy as a train action: NonFiniteLossError when a loop's
  watched metrics (`loss`, else all) are not finite under nan_policy=stop,
  or after `max_skipped_steps` skipped steps in a row (nan_policy=skip),
  before the loop's checkpoint."""

  def __init__(self, controller: Any):
    self.controller = controller

  def __call__(self, step: int, outputs: Mapping[str, float]) -> None:
    c = self.controller
    trainer = c.trainer
    policy = protocols.nan_policy(trainer)
    if policy == "skip" and isinstance(trainer, protocols.SkipCounting):
      in_a_row = int(trainer.consecutive_skips.numpy())
      if in_a_row >= trainer.max_skipped_steps:
        raise NonFiniteLossError(
            f"{in_a_row} steps in a row were skipped (steps "
            f"{step - in_a_row + 1}..{step}: non-finite loss or gradient; "
            f"max_skipped_steps={trainer.max_skipped_steps}); stopped "
            f"without saving (latest good checkpoint: "
            f"{c.checkpoints.latest or 'none'}); lower learning_rate or set "
            "clip_norm")
    if not c.loss_finite and policy == "stop":
      raise NonFiniteLossError(
          f"{c.non_finite_text(checkpoint=False)}; stopped without saving "
          f"(latest good checkpoint: {c.checkpoints.latest or 'none'}); "
          "lower learning_rate, set clip_norm, or use nan_policy=skip")


class ProfileReport:
  """Stops the profiler at its window's end; logs and summarises the op
  table. (The window starts right before its first loop.)"""

  def __init__(self, controller: Any):
    self.controller = controller

  def __call__(self, step: int, outputs: Mapping[str, float]) -> None:
    self.controller.report_profile(
        self.controller.profiler.maybe_stop(step), step)


def from_on_loop_end(fn: Callable[[int], Any]) -> Action:
  """An old `on_loop_end` hook `fn(step)` as a train action."""
  return lambda step, outputs: fn(step)
