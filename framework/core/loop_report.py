"""What each training loop reports: its outputs, its log lines, and what
was not finite in it.

A loop's outputs are the trainer's mean metrics plus `learning_rate`,
`steps_per_second`, `examples_per_second` (a `BatchSized` trainer) and
`skipped_steps` (a `SkipCounting` trainer that skips: nan_policy=skip or
float16 loss scaling); they are what the train actions get and what
`train/` summarises. The log line puts `loss` first and counts the ETA to
`train_steps`.
"""

import math
import time
from typing import Any, Mapping

from absl import logging
import keras

from framework.core import protocols


def learning_rate(optimizer: keras.optimizers.Optimizer) -> float:
  """The optimizer's current learning rate as a float, whatever it holds: a
  constant, a (mirrored) variable, or a schedule evaluated at its step."""
  return float(keras.ops.convert_to_numpy(optimizer.learning_rate))


def format_seconds(seconds: float) -> str:
  """`H:MM:SS`."""
  seconds = int(seconds)
  return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def non_finite_text(first: int, last: int,
                    watched: Mapping[str, float]) -> str:
  """What was not finite in steps `first..last`."""
  bad = ", ".join(f"{k} is {v}" for k, v in sorted(watched.items())
                  if not math.isfinite(v))
  return f"{bad} in steps {first}..{last}"


class LoopReport:
  """A run's loop outputs and log lines.

  Args:
    trainer: the `LoopTrainer` (its `optimizer`, and `global_batch_size`
      and skip counters where it declares them).
    train_steps: where the run ends (the ETA's end).
    stop_condition: the run's condition, or None (said in the first line).
  """

  def __init__(self, trainer: Any, train_steps: int,
               stop_condition: Any = None):
    self.trainer = trainer
    self.train_steps = train_steps
    self.stop_condition = stop_condition
    self.global_batch_size = (trainer.global_batch_size if isinstance(
        trainer, protocols.BatchSized) else None)
    self.counts_skips = isinstance(trainer, protocols.SkipCounting) and (
        protocols.nan_policy(trainer) == "skip"
        or trainer.loss_scale is not None)
    self._start = None
    # Whether the last loop's watched metrics were finite (the restored
    # state counts as finite), and that loop (first, last, watched).
    self.finite = True
    self.last_loop = None

  def before_loop(self, step: int, num_steps: int) -> None:
    """Before the first loop, a line (nothing else prints while tracing)."""
    if self._start is not None:
      return
    self._start = (step, time.time())
    logging.info(
        "training steps %d..%d (the ETA counts to step %d%s); the first "
        "loop (%d steps) includes tracing the train step", step + 1,
        self.train_steps, self.train_steps,
        "" if self.stop_condition is None else
        ", train_steps: the stop condition may end the run earlier",
        num_steps)

  def watch(self, first: int, last: int, metrics: Mapping[str, float],
            elapsed: float) -> bool:
    """Records whether the loop of steps `first..last` was finite."""
    if self.last_loop is None:
      logging.info("first loop done in %.1f s (tracing included)", elapsed)
    watched = protocols.watched_metrics(metrics)
    self.finite = all(math.isfinite(v) for v in watched.values())
    self.last_loop = (first, last, watched)
    return self.finite

  def non_finite_text(self) -> str:
    """What was not finite in the last loop."""
    return non_finite_text(*self.last_loop)

  def outputs(self, metrics: Mapping[str, float], num_steps: int,
              elapsed: float) -> dict:
    """The loop's metrics plus learning rate, speed and skipped steps."""
    outputs = dict(metrics)
    outputs["learning_rate"] = learning_rate(self.trainer.optimizer)
    outputs["steps_per_second"] = num_steps / elapsed
    if self.global_batch_size is not None:
      outputs["examples_per_second"] = (
          num_steps * self.global_batch_size / elapsed)
    if self.counts_skips:
      outputs["skipped_steps"] = float(self.trainer.skipped_steps.numpy())
    return outputs

  def log(self, step: int, metrics: Mapping[str, float],
          outputs: Mapping[str, float]) -> None:
    """The `train step N/M: ...` line, with the ETA since `first_loop`."""
    start_step, start_time = self._start or (step, time.time())
    rate = (step - start_step) / max(time.time() - start_time, 1e-9)
    eta = (self.train_steps - step) / max(rate, 1e-9)
    logging.info(
        "train step %d/%d: %s%s ETA %s %s%s", step, self.train_steps,
        " ".join(f"{k}={v:.4f}" for k, v in
                 sorted(metrics.items(), key=lambda kv: kv[0] != "loss")),
        (f" examples/s={outputs['examples_per_second']:.1f}"
         if "examples_per_second" in outputs else
         f" steps/s={outputs['steps_per_second']:.2f}"),
        format_seconds(eta), f"to step {self.train_steps}",
        f" skipped_steps={int(outputs['skipped_steps'])}"
        if "skipped_steps" in outputs else "")


def report_profile(table: Any, profile_steps: Any, writer: Any,
                   step: int) -> None:
  """Logs a profiler window's op table and writes it to `train/` (if any)."""
  if table is None:
    return
  first, last = profile_steps
  logging.info("profile of steps %d..%d (trace: %s):\n%s", first, last,
               table.trace_path, table.markdown(top=10))
  writer("train").text(step, "profile/op_time", table.markdown())
