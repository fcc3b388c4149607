"""The outer loop: steps, checkpoints, summaries, evaluation and actions.

    restore the latest checkpoint; iterator = batches from its step on
    while step < train_steps:
      n = steps to the next event (`framework.core.loop_schedule`)
      outputs = trainer.train(iterator, n)   # fewer steps when asked to stop
      summaries and log line (`loop_report`); train actions (NaN policy,
      stop_when, profiler, preemption, yours); save / evaluate (+ eval
      actions) when due; end here if a stop was asked
    save and evaluate at the end

The trainer owns the math of a step (`framework.core.protocols` says what
the Controller reads of it); the Controller everything around it.
"""

import functools
import os
import time
from typing import Any, Callable, Optional, Sequence

from absl import logging
import tensorflow as tf

from framework.distribute import strategies
from framework.perf import profiling
from framework.core import actions as actions_lib
from framework.core import eval_sets as eval_sets_lib
from framework.core import metric_sinks as metric_sinks_lib
from framework.core import (best_checkpoint, eval_batching, loop_report,
                            loop_schedule, progress, protocols,
                            target_tracker)
from framework.core.checkpointing import CheckpointManager
from framework.core.config import LoopConfig  # pylint: disable=unused-import
from framework.core.loop_report import learning_rate  # pylint: disable=unused-import
from framework.errors import NonFiniteLossError
from framework.core.summaries import Writers, markdown_table, record_every


class Controller:
  """Runs a trainer for `config.train_steps` with checkpoints and summaries.

  The trainer: a `framework.Trainer` (or subclass), or any object that
  implements `framework.core.protocols.LoopTrainer` (`model`, `optimizer`,
  `strategy`, `global_step`, `train(iterator, num_steps) -> {name:
  scalar}`, `sync_replica_state()`; and `LoopEvaluator`'s
  `evaluate(distributed_dataset)` to evaluate). The Controller reads
  nothing else of it but the optional protocols declared there, each with
  its default when absent (`global_batch_size`, `nan_policy`, the skip
  counters, `request_stop`, `distribute_dataset`, `metric_aliases`, ...).
  Every returned metric is logged and summarised under its own name; the
  NaN policy watches `loss` if the trainer returns one, else every value.

  Inputs (`framework.core.eval_batching`): `train_input(start_step)`
  returns endless global batches from `start_step` on, `eval_input()` one
  pass over the eval set; `eval_inputs={"test": fn, ...}` adds named sets,
  each evaluated into `model_dir/eval_<name>` (`framework.core.eval_sets`).

  Actions (`framework.core.actions`): train actions `fn(step, outputs)`
  run after each loop's summaries and log line, before its checkpoint and
  evaluation; eval actions `fn(step, results)` after each evaluation. An
  action that returns `actions.Stop(reason)`, or `request_stop(reason)`
  (from an action or another thread), ends the run after the current
  loop's events with a normal end's artifacts (final checkpoint and
  evaluation). `tf.summary.*` calls inside the trainer's step go to
  `train/` on the steps `summary_every` divides, inside the evaluator's to
  `eval/`.

  `time_to_target`: the wall time from `start_time` (default: the start
  of `run()`) to the first evaluation (or loop) that meets
  `config.stop_when` / `stop_at_accuracy` (`framework.core.target_tracker`).

  Args:
    trainer: a `LoopTrainer` (e.g. `framework.Trainer`).
    config: a `LoopConfig`.
    model_dir: checkpoints here; TensorBoard in `train/` and `eval/`.
    train_input: `start_step -> dataset` of global batches.
    eval_input: `() -> dataset` over the whole eval set, or None.
    eval_inputs: {name: `() -> dataset`}: more eval sets (`eval_<name>/`).
    hparams: a dict (e.g. the run's flags) written as a text summary and
      to TensorBoard's HParams dashboard (`model_dir` is the session).
    checkpoint_items: trackables to checkpoint besides model, optimizer
      and global step.
    train_actions, eval_actions: run after the built-in ones (NaN policy,
      profiler report); `self.train_actions` / `self.eval_actions` take
      more.
    evaluator: a `LoopEvaluator` (default: the trainer).
    on_loop_end: deprecated: callables `fn(step)`, run as train actions.
    metric_sinks: `framework.core.summaries.MetricSink`s for every scalar
      point besides TensorBoard and `model_dir/metrics.jsonl` (chief only).
    `self.on_train_end`: `fn(step)` run after the final checkpoint, before
      the final evaluation (one that returns a dict: the run's results).
  """

  def __init__(self, trainer: protocols.LoopTrainer, config: LoopConfig,
               model_dir: str, *, train_input: Callable[[int], Any],
               eval_input: Optional[Callable[[], Any]] = None,
               eval_inputs: Optional[dict] = None,
               hparams: Optional[dict] = None,
               checkpoint_items: Optional[dict] = None,
               train_actions: Sequence[actions_lib.Action] = (),
               eval_actions: Sequence[actions_lib.Action] = (),
               evaluator: Optional[protocols.LoopEvaluator] = None,
               on_loop_end: Sequence[Callable[[int], Any]] = (),
               metric_sinks: Sequence[Any] = ()):
    self.eval_sets = eval_sets_lib.collect(eval_input, eval_inputs)
    self.evaluator = protocols.loop_evaluator(trainer, evaluator,
                                              bool(self.eval_sets))
    self.trainer = trainer
    self.config = config
    # Absolute once, here: checkpoints, summaries and the profiler join paths
    # onto it, and TensorFlow joins a relative one twice.
    if "://" not in model_dir:
      model_dir = os.path.abspath(model_dir)
    self.model_dir = model_dir
    self.train_input = train_input
    self.eval_input = eval_input
    self.hparams = hparams or {}
    chief = strategies.is_chief(trainer.strategy)
    self.checkpoint = tf.train.Checkpoint(
        **protocols.checkpoint_objects(trainer, checkpoint_items))
    self.checkpoints = CheckpointManager(
        self.checkpoint, model_dir, trainer.strategy,
        max_to_keep=config.keep_checkpoints)
    # Every scalar also goes to model_dir/metrics.jsonl and these sinks.
    self.metric_sinks = [metric_sinks_lib.JsonlSink(os.path.join(
        model_dir, metric_sinks_lib.METRICS_FILE)), *metric_sinks] if (
            chief) else []
    self.writer = Writers(model_dir, enabled=chief, sinks=self.metric_sinks)
    self._restored = False
    self.restored_from = None  # the checkpoint restore() restored, if any
    self.last_eval, self._last_eval_step = None, None
    self.eval_results = {}  # {split: results} of the latest evaluation
    self.on_train_end = []
    self.stop_reason = self.start_time = None
    self.steps_per_epoch = None  # if known: best.json's epoch
    # The chief traces; other workers run the same ops.
    self.profiler = profiling.StepProfiler(
        config.profile_steps if chief else (),
        os.path.join(model_dir, "train"))
    self.train_actions = [actions_lib.NanGuard(self),
                          actions_lib.ProfileReport(self),
                          *train_actions]
    self.eval_actions = list(eval_actions)
    self.batching = eval_batching.Batching(trainer, self.evaluator)
    self.report = loop_report.LoopReport(trainer, config.train_steps,
                                         config.stop_condition())
    self.targets = target_tracker.TargetTracker(
        config, model_dir, chief=chief, writer=self.writer,
        aliases=protocols.metric_aliases(self.evaluator))
    stop = self.targets.stop_action(
        functools.partial(eval_sets_lib.results_of, self))
    if stop is not None:
      (self.train_actions if stop.condition.split == "train"
       else self.eval_actions).append(stop)
    # best/ and early stopping (`best_metric`), after the stop condition.
    self.best = best_checkpoint.from_config(self, config)
    # Deprecated: run after the train actions, each as `fn(step)`.
    self.on_loop_end = list(on_loop_end)

  @property
  def step(self) -> int:
    return int(self.trainer.global_step.numpy())

  def request_stop(self, reason: str = "requested") -> None:
    """Ends the run after the current loop's events, as at `train_steps`.
    Under a multi-worker strategy every worker must ask at the same loop
    (an action deciding on eval results, which all workers share, does)."""
    if self.stop_reason is None:
      self.stop_reason = reason
      logging.info("stop requested (%s): ending the run after this loop",
                   reason)

  def save(self, step: int) -> Optional[str]:
    """Checkpoints at `step` (every worker must call it); returns the path,
    or None without saving when the last loop's loss was not finite."""
    if not self.loss_finite:
      logging.warning("Not saving a checkpoint at step %d: %s", step,
                      self.non_finite_text())
      return None
    self.trainer.sync_replica_state()
    return self.checkpoints.save(step)

  @property
  def loss_finite(self) -> bool:
    """Whether the last loop's watched metrics were finite."""
    return self.report.finite

  def non_finite_text(self, checkpoint: bool = True) -> str:
    """What was not finite in the last loop (and the latest checkpoint)."""
    text = self.report.non_finite_text()
    if checkpoint:
      text += (f" (latest good checkpoint: "
               f"{self.checkpoints.latest or 'none'})")
    return text

  def evaluate(self) -> Optional[dict]:
    """Evaluates every eval set (summaries in `eval/`, `eval_<name>/`, with
    `elapsed_seconds` since `start_time`) and runs the eval actions. A
    fresh Controller restores the latest checkpoint first if there is one,
    else evaluates the weights the model holds (Orbit's semantics)."""
    if not self.eval_sets:
      return None
    self.restore()
    self.trainer.sync_replica_state()
    step = self.step
    self.eval_results = {
        split: eval_sets_lib.evaluate_one(self, split, fn, step)
        for split, fn in self.eval_sets.items()}
    # The actions get the primary set's (eval/, else the first).
    results = next(iter(self.eval_results.values()))
    self.last_eval, self._last_eval_step = results, step
    self._act(self.eval_actions, step, results)
    return results

  def report_profile(self, table: Optional[profiling.OpTable],
                     step: int) -> None:
    """Logs and summarises a profiler window's op table (if any)."""
    loop_report.report_profile(table, self.config.profile_steps,
                               self.writer, step)

  def restore(self) -> None:
    """Restores the latest checkpoint, once (CheckpointError on mismatch)."""
    if not self._restored:
      self.restored_from = self.checkpoints.restore_latest()
      self._restored = True
      self.writer.restart(self.step)  # the steps after it train again

  def run(self) -> Optional[dict]:
    """Trains to `train_steps` (or a stop request), resuming from the latest
    checkpoint; the final evaluation's results (None without eval_input)."""
    c = self.config
    progress.show_progress_by_default()
    if self.start_time is None:
      self.start_time = time.time()
    self.restore()
    step = self.step
    record = self.targets.finished(step) or (
        self.best.finished(step) if self.best is not None else None)
    if record is not None:
      self.last_eval = record.get("metrics") or None
      return self._train_end(step, self.last_eval)
    self.targets.resume(step)
    if step >= c.train_steps:
      logging.info("Already at step %d of %d; nothing to train", step,
                   c.train_steps)
      self.targets.measuring = False  # measured (or not) when it trained
      return self._train_end(step, None) or self.evaluate()
    self.writer("train").text(step, "flags", markdown_table(self.hparams))
    self.writer("").hparams(self.hparams)  # model_dir: train/, eval/ below.
    iterator = iter(self.batching.train(self.train_input(step)))
    try:
      step, last_saved = self._train_loops(iterator, step)
    finally:
      # A window past the last step, or a run that stopped inside it.
      self.report_profile(self.profiler.maybe_stop(self.step, force=True),
                          self.step)
    if not self.loss_finite:
      raise NonFiniteLossError(
          f"{self.non_finite_text()}; the run ended without saving a final "
          "checkpoint or weights: lower learning_rate, set clip_norm, or "
          "train on from the last good checkpoint")
    if last_saved != step:
      self.save(step)
    self.targets.record(step, self.last_eval)
    self._train_end(step, None)
    if self._last_eval_step == step and self.last_eval is not None:
      results = self.last_eval  # stopped right after an evaluation
    else:
      results = self.evaluate()
    self.targets.record(step, self.last_eval)
    self.targets.report_missed(step)
    return results

  @property
  def time_to_target(self) -> Optional[float]:
    """Seconds from `start_time` to the target (None: not reached)."""
    return self.targets.time_to_target

  @property
  def measure_target(self) -> bool:
    """Whether this launch measures the time to target."""
    return self.targets.measuring

  def _train_end(self, step, results):
    """Runs the `on_train_end` callables; `results`, or those returned."""
    for fn in self.on_train_end:
      reported = fn(step)
      if isinstance(reported, dict):
        self.last_eval = results = reported
    return results

  def _act(self, actions, step, outputs):
    """Runs `actions` and applies what they return (`actions.Stop`)."""
    for action in actions:
      decision = action(step, outputs)
      if isinstance(decision, actions_lib.Stop) and (
          not isinstance(decision, actions_lib.TargetReached)
          or self.targets.reached(step, decision, self.start_time)):
        self.request_stop(decision.reason)

  def _train(self, iterator, num_steps):
    """`trainer.train` as floats; a partial batch becomes a DataError."""
    try:
      with self.writer("train").as_default(self.trainer.global_step), (
          tf.summary.record_if(record_every(self.config.summary_every))):
        return {k: float(v) for k, v in
                self.trainer.train(iterator, num_steps).items()}
    except tf.errors.InvalidArgumentError as e:
      error = self.batching.train_error(e)
      if error is None:
        raise
      raise error from None

  def _train_loops(self, iterator, step):
    """Loops from `step` to `train_steps`; (last step, last saved step)."""
    c = self.config
    last_saved = step
    while step < c.train_steps:
      num_steps = loop_schedule.steps_to_next_event(
          c, step, self.profiler.boundaries())
      self.profiler.maybe_start(step)
      self.report.before_loop(step, num_steps)
      loop_start = time.time()
      metrics = self._train(iterator, num_steps)
      elapsed = time.time() - loop_start
      # Fewer steps than asked when the loop was told to stop.
      step, num_steps = self.step, self.step - step
      self.report.watch(step - num_steps + 1, step, metrics, elapsed)
      outputs = self.report.outputs(metrics, num_steps, elapsed)
      if loop_schedule.due(c.summary_every, step) or step == c.train_steps:
        self.writer("train").scalars(step, outputs)
      if loop_schedule.due(c.log_every, step) or step == c.train_steps:
        self.report.log(step, metrics, outputs)
      self._act(self.train_actions, step, outputs)
      for fn in self.on_loop_end:
        fn(step)
      if loop_schedule.due(c.checkpoint_every, step):
        self.save(step)  # skipped with a warning after a non-finite loss
        last_saved = step if self.loss_finite else last_saved
      if (loop_schedule.due(c.eval_every, step) and step != c.train_steps
          and step >= c.eval_start_step):
        self.evaluate()
      if protocols.take_stop_request(self.trainer):  # in the loop or after
        self.request_stop("trainer.request_stop()")
      if self.stop_reason is not None:
        logging.info("run ends at step %d of %d: %s", step, c.train_steps,
                     self.stop_reason)
        break
    return step, last_saved
