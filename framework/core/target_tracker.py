"""Time to target: when a run first meets its stop condition, and the
record that lets a relaunch of a finished run train nothing.

`LoopConfig.stop_when` / `stop_at_accuracy` become a `StopWhen` action
(after every loop for a train/ condition, after every evaluation else).
It returns `TargetReached`; the tracker applies it once: `time_to_target`
is the wall time from the Controller's `start_time` to the end of that
evaluation (or loop): everything in between counts (building the input
pipeline, tracing, every step, every evaluation, checkpoints and
summaries). `start_time` defaults to the start of `Controller.run()`;
`experiment.run` sets it to its own start, so loading the dataset and
building the model count too. A resumed run counts from its own start.

The target's metric is `accuracy` under the name the evaluator reports it
(`protocols.metric_aliases`, e.g. a task's own name for it). With
`stop_at_accuracy` the chief writes `target_reached.json` beside the final
checkpoint (`framework.core.run_state`): relaunched with the same settings
the run trains nothing; with more steps it continues past the target
without stopping at it again (a higher target is a new one).
"""

import time
from typing import Any, Callable, Mapping, Optional

from absl import logging

from framework.core import actions as actions_lib
from framework.core import run_state

TARGET_METRIC = "accuracy"


class TargetTracker:
  """Tracks a run's stop condition and its time to target.

  Args:
    config: the run's `LoopConfig` (`stop_when`, `stop_at_accuracy`,
      `train_steps`).
    model_dir: where `target_reached.json` goes.
    chief: whether this task writes it.
    writer: `split -> SummaryWriter` (`time_to_target_seconds` goes under
      the condition's split).
    aliases: {metric: the name the evaluator reports it under}.
  """

  def __init__(self, config: Any, model_dir: str, *, chief: bool,
               writer: Callable[[str], Any],
               aliases: Optional[Mapping[str, str]] = None):
    self.config = config
    self.model_dir = model_dir
    self.chief = chief
    self.writer = writer
    self.aliases = dict(aliases or {})
    self.condition = config.stop_condition()
    self.time_to_target = None
    # False once the target was met by an earlier launch (or not trained
    # for): this launch neither stops at it nor measures it again.
    self.measuring = True

  def stop_action(self, results: Callable[[str, Mapping[str, float]],
                                          Mapping[str, float]]
                  ) -> Optional[actions_lib.StopWhen]:
    """The `StopWhen` action for the condition (None without one);
    `results` gives an eval split's latest results."""
    if self.condition is None:
      return None
    c = self.config
    return actions_lib.StopWhen(
        self.condition, description=(
            f"{TARGET_METRIC} {c.stop_at_accuracy:.4f}"
            if c.stop_when is None else None),
        results=results, aliases=self.aliases)

  def finished(self, step: int) -> Optional[dict]:
    """The record of an earlier launch that stopped at this target at
    `step` (then nothing is left to train: logged), else None."""
    c = self.config
    record = run_state.read_target(self.model_dir)
    if not run_state.finished_at_target(record, step, c.train_steps,
                                        c.stop_at_accuracy):
      return None
    logging.info(
        "Already finished: %s %.4f reached stop_at_accuracy=%.4f at step %d "
        "(%s); nothing to train (raise train_steps or the target to "
        "continue)", TARGET_METRIC, record["accuracy"], c.stop_at_accuracy,
        step, run_state.TARGET_FILE)
    return record

  def resume(self, step: int) -> None:
    """A run restored at `step` trains on: past a target it met (kept, not
    measured again), or from a record it no longer meets (removed)."""
    c = self.config
    record = run_state.read_target(self.model_dir)
    if run_state.continues_past_target(record, step, c.stop_at_accuracy):
      self.measuring = False
      logging.info(
          "%s %.4f reached stop_at_accuracy=%.4f at step %d "
          "(time_to_target_seconds=%.1f, kept in %s); training on to step "
          "%d without stopping at that target again (a higher "
          "stop_at_accuracy is a new target)", TARGET_METRIC,
          record["accuracy"], c.stop_at_accuracy, int(record["step"]),
          float(record.get("time_to_target_seconds", float("nan"))),
          run_state.TARGET_FILE, c.train_steps)
    elif record is not None and self.chief:
      run_state.forget_target(self.model_dir)

  def reached(self, step: int, decision: actions_lib.TargetReached,
              start_time: Optional[float]) -> bool:
    """Applies `StopWhen`'s decision: the first one records the time to
    target (summary and log line); whether the run stops."""
    if self.time_to_target is not None or not self.measuring:
      return False
    self.time_to_target = time.time() - (start_time or time.time())
    split = decision.condition.split
    self.writer(split).scalars(
        step, {"time_to_target_seconds": self.time_to_target})
    logging.info("target %s reached at step %d: %s=%.4f "
                 "time_to_target_seconds=%.1f",
                 decision.description or decision.condition, step,
                 decision.metric, decision.value, self.time_to_target)
    return True

  def record(self, step: int, results: Optional[Mapping[str, float]]
             ) -> None:
    """The chief records a reached `stop_at_accuracy` beside the checkpoint
    at `step`, with the final `results`."""
    if (self.time_to_target is None or not self.chief or results is None
        or self.config.stop_at_accuracy is None):
      return
    name = (TARGET_METRIC if TARGET_METRIC in results
            else self.aliases.get(TARGET_METRIC, TARGET_METRIC))
    run_state.record_target(
        self.model_dir, step=step,
        stop_at_accuracy=self.config.stop_at_accuracy,
        accuracy=results.get(name), train_steps=self.config.train_steps,
        time_to_target=self.time_to_target, metrics=results)

  def report_missed(self, step: int) -> None:
    """Logs a condition this launch measured and did not meet."""
    c = self.config
    if (self.condition is not None and self.time_to_target is None
        and self.measuring):
      logging.info("target %s not reached in %d steps",
                   f"{TARGET_METRIC} {c.stop_at_accuracy:.4f}"
                   if c.stop_when is None else self.condition, step)
