"""Actions: `fn(step, outputs)` called by the Controller after each loop.

A train action gets the loop's outputs (the trainer's mean metrics plus
`learning_rate`, `steps_per_second`, ...), after they were logged and
summarised and before the loop's checkpoint and evaluation; an eval action
gets each evaluation's results. An action may raise (the run ends there,
saving nothing more) or return what it decides: `Stop(reason)` (or call
`controller.request_stop(reason)`) ends the run after this loop's
checkpoint and evaluation as at `train_steps` (final checkpoint,
evaluation, and with `experiment.run` the weights file and the export).

Built in: the NaN policy (`NanGuard`), early stopping (`StopWhen`, from
`LoopConfig.stop_when` / `stop_at_accuracy`), the profiler's report,
preemption (`framework.core.preemption.install`) and the segmentation mask
summaries; `LossAtChance`, a one-line warning when the training loss
stays at chance.
"""

import dataclasses
import math
from typing import Any, Callable, Mapping, Optional

from absl import logging

from framework.core import protocols
from framework.core.stop_condition import StopCondition
from framework.errors import NonFiniteLossError

Action = Callable[[int, Mapping[str, float]], Any]


@dataclasses.dataclass(frozen=True)
class Stop:
  """What an action returns to end the run (as `request_stop(reason)`)."""
  reason: str


@dataclasses.dataclass(frozen=True)
class TargetReached(Stop):
  """`StopWhen`'s decision: `condition` met, `metric` at `value`. The
  Controller's target tracker records the time to target and stops the run
  (unless that target was already reached, or the run continues past it)."""
  condition: StopCondition = None
  metric: str = ""
  value: float = float("nan")
  description: Optional[str] = None


class StopWhen:
  """Decides the first time `condition` holds: returns `TargetReached`
  (the Controller then stops the run and records the time to target),
  else None.

  Args:
    condition: a `StopCondition`.
    description: how the log names the target (default: the condition).
    results: `(split, results) -> results` of that eval split (e.g. the
      Controller's `eval_sets.results_of`); None: the results given.
    aliases: {metric: name the evaluator reports it under}
      (`protocols.metric_aliases`).
  """

  def __init__(self, condition: StopCondition,
               description: Optional[str] = None, *,
               results: Optional[Callable[[str, Mapping[str, float]],
                                          Mapping[str, float]]] = None,
               aliases: Optional[Mapping[str, str]] = None):
    self.condition = condition
    self.description = description
    self.results = results
    self.aliases = dict(aliases or {})

  def __call__(self, step: int,
               outputs: Mapping[str, float]) -> Optional[TargetReached]:
    condition = self.condition
    if condition.split != "train" and self.results is not None:
      outputs = self.results(condition.split, outputs)
    if not condition.met(outputs, self.aliases):
      return None
    return TargetReached(
        reason=f"stop_when {condition}", condition=condition,
        metric=condition.metric,
        value=condition.metric_value(outputs, self.aliases),
        description=self.description)


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


class LossAtChance:
  """Warns once, in one line, when the training loss has not moved from
  chance (ln(classes), a classifier's loss at uniform logits) after
  `examples_per_class` examples per class: the run is learning nothing.

  The usual causes are named: inputs scaled twice (a model that rescales
  images the pipeline already divided by 255), a learning rate of 0 or far
  too small, or frozen (non-trainable) weights.
  """

  def __init__(self, num_classes, global_batch_size, examples_per_class=300,
               tolerance=0.01):
    self.num_classes = num_classes
    self.chance = math.log(num_classes) if num_classes > 1 else None
    self.after_examples = examples_per_class * num_classes
    self.global_batch_size = global_batch_size
    self.tolerance = tolerance
    self.done = False

  def __call__(self, step, outputs):
    loss = outputs.get("loss")
    if (self.done or self.chance is None or loss is None
        or step * self.global_batch_size < self.after_examples):
      return None
    self.done = True  # once: the first loop past the threshold decides
    if abs(float(loss) - self.chance) <= self.tolerance * self.chance:
      logging.warning(
          "train loss %.4f at step %d is still ln(classes)=%.4f, chance, "
          "after %d examples (%d per class): the model is not learning; "
          "usual causes: inputs scaled twice (a model that rescales what "
          "the pipeline already divided by 255), a learning rate of 0 or "
          "far too small, frozen (non-trainable) weights", float(loss),
          step, self.chance, step * self.global_batch_size,
          step * self.global_batch_size // self.num_classes)
    return None
