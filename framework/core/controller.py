"""The outer loop: steps, checkpoints, summaries, evaluation and actions.

    restore the latest checkpoint; iterator = batches from its step on
    while step < train_steps:
      n = steps to the next event (`steps_to_next_event`)
      outputs = trainer.train(iterator, n)   # fewer steps when asked to stop
      summaries and log line (`LoopReport`); train actions (NaN policy,
      stop_when, profiler, preemption, yours); save / evaluate (+ eval
      actions) when due; end here if a stop was asked
    save and evaluate at the end

The trainer owns the math of a step (`framework.core.protocols` says what
the Controller reads of it); the Controller everything around it. This
module holds the loop and its parts: what it is handed (`LoopParts`,
`loop_parts`), when a loop's events fall
(`steps_to_next_event`), what a loop reports (`LoopReport`: outputs, the
log line, non-finite steps) and INFO progress from plain Python
(`enable_logging`).
"""

import contextlib
import dataclasses
import functools
import logging as std_logging
import math
import os
import time
from typing import (Any, Callable, ContextManager, Optional, Sequence,
                    Mapping, Union)

from absl import logging, flags
import keras
import tensorflow as tf

from framework.core import actions as actions_lib
from framework.core import adapt
from framework.core import (evaluation, goodput, protocols, spikes,
                            summaries)
from framework.core.checkpoints import best
from framework.core.checkpoints import (CheckpointManager, checkpoint_objects,
                                        for_loop)
from framework.core.config import LoopConfig, TrainerConfig
from framework.core.summaries import Writers, markdown_table, record_every
from framework.distribute import strategies
from framework.errors import NonFiniteLossError, ConfigError
from framework.perf import profiling, throughput
from framework.settings import default


class Controller:
  """Runs a trainer for `config.train_steps` with checkpoints and summaries.

  The Controller calls the trainer through `train(iterator, num_steps) ->
  {name: scalar}` and `sync_replica_state()` (before saves and
  evaluations) only, and the evaluator through `evaluate(distributed_dataset)`
  (`framework.core.protocols.LoopTrainer`, `LoopEvaluator`). What it does
  not compute it is handed (Orbit's way): `parts`, a
  `LoopParts` (below: the global step, the strategy, what
  a checkpoint holds, the NaN policy and skip count, the batch size, ...)
  and `checkpoints`, the `CheckpointManager` it saves through
  (`framework.core.checkpoints.for_loop(parts, model_dir, ...)`). Without
  them it reads the parts once from the trainer
  (`loop_parts(trainer)`: a `framework.Trainer` has them all) and
  builds the manager itself. Every returned metric is logged and summarised
  under its own name; the NaN policy watches `loss` if the trainer returns
  one, else every value.

  Inputs (`framework.core.evaluation`): `train_input(start_step)`
  returns endless global batches from `start_step` on, `eval_input()` one
  pass over the eval set; `eval_inputs={"test": fn, ...}` adds named sets,
  each evaluated into `model_dir/eval_<name>` (`framework.core.evaluation`).

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
  `config.stop_when` / `stop_at_accuracy` (`framework.core.actions`).

  Long runs: `goodput` (`framework.core.goodput.Goodput`, set by `run()`)
  accounts the run's wall time over its relaunches (`model_dir/
  goodput.json`, one log line and `train/goodput/*` at the end); a policy
  that drops steps reports them with `goodput.lost_steps(n, reason)` or
  `goodput.restored(step, reason)`. On a multi-worker cluster each
  worker's step time, split into compute and all-reduce wait, goes to
  `train/step_time/*`, and the chief names workers slower than the other
  workers' median by `config.straggler_factor`
  (`summaries.WorkerStepTimes`).

  Args:
    trainer: a `LoopTrainer` (e.g. `framework.Trainer`); without `parts`,
      also its `model`, `optimizer`, `strategy` and `global_step`.
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
    parts: the run's `LoopParts` (default: `loop_parts(trainer,
      evaluator, checkpoint_items)`).
    checkpoints: the `CheckpointManager` to save through, what it holds
      its own (default: `checkpoints.for_loop(parts, model_dir,
      max_to_keep=config.keep_checkpoints)`).
    steps_per_epoch: the steps of one pass over the training data, when
      known (`best.json` records the epoch of the best evaluation).
    on_train_end: callables `fn(step)` run after the final checkpoint,
      before the final evaluation (one that returns a dict: the run's
      results); `self.on_train_end` takes more.
    start_time: what `time_to_target` and `elapsed_seconds` count from
      (default: the start of `run()`), e.g. the run's start before its
      data loaded.
    handle_preemption: SIGTERM or a first Ctrl-C saves a checkpoint and
      exits with `actions.EXIT_PREEMPTED` (`framework.core.actions.install`,
      installed when `run()` starts: until then the caller's handler, e.g.
      `actions.guard_start`'s, answers).
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
               metric_sinks: Sequence[Any] = (),
               parts: Optional["LoopParts"] = None,
               checkpoints: Optional[CheckpointManager] = None,
               steps_per_epoch: Optional[int] = None,
               on_train_end: Sequence[Callable[[int], Any]] = (),
               start_time: Optional[float] = None,
               handle_preemption: bool = False):
    self.eval_sets = evaluation.collect(eval_input, eval_inputs)
    self.evaluator = loop_evaluator(trainer, evaluator,
                                              bool(self.eval_sets))
    if parts is None:
      parts = loop_parts(trainer, self.evaluator, checkpoint_items)
    elif checkpoint_items:
      parts.checkpoint.update(checkpoint_items)
    self.parts = parts
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
    chief = strategies.is_chief(parts.strategy)
    self.checkpoints = checkpoints or for_loop(
        parts, model_dir, max_to_keep=config.keep_checkpoints,
        async_checkpoint=config.async_checkpoint,
        sharding=config.checkpoint_sharding)
    self.checkpoint = self.checkpoints.checkpoint
    # Every scalar also goes to model_dir/metrics.jsonl and these sinks.
    self.metric_sinks = [summaries.JsonlSink(os.path.join(
        model_dir, summaries.METRICS_FILE)), *metric_sinks] if (
            chief) else []
    self.writer = Writers(model_dir, enabled=chief, sinks=self.metric_sinks)
    self._restored = False
    self.restored_from = None  # the checkpoint restore() restored, if any
    self.last_eval, self._last_eval_step = None, None
    self.eval_results = {}  # {split: results} of the latest evaluation
    self.on_train_end = list(on_train_end)
    self.goodput = None  # the run's `goodput.Goodput`, once `run()` trains
    self._unlisted = None  # the step of a background write not yet waited for
    self.stop_reason = None
    self.start_time = start_time
    self.handle_preemption = handle_preemption
    self.preemption = None  # the handler, once `run()` installed it
    self.steps_per_epoch = steps_per_epoch  # if known: best.json's epoch
    # The chief traces; other workers run the same ops.
    self.profiler = profiling.StepProfiler(
        config.profile_steps if chief else (),
        os.path.join(model_dir, "train"))
    self.train_actions = [actions_lib.NanGuard(self),
                          actions_lib.ProfileReport(self),
                          *train_actions]
    self.eval_actions = list(eval_actions)
    # Each worker's step time, split (a cluster's trainer measures it).
    self.step_times = None if parts.collective_wait is None else (
        summaries.WorkerStepTimes(parts.strategy, parts.collective_wait,
                                  self.writer, config.straggler_factor))
    self.batching = evaluation.Batching(parts)
    # The batches loss-spike rollbacks skipped (a relaunch skips them too).
    self.rollbacks = spikes.RollbackRecord(model_dir)
    self.report = LoopReport(parts, config.train_steps,
                             config.stop_condition())
    self.report.rolled_back_steps = self.rollbacks.rolled_back_steps
    self.targets = actions_lib.TargetTracker(
        config, model_dir, chief=chief, writer=self.writer,
        aliases=parts.metric_aliases)
    stop = self.targets.stop_action(
        functools.partial(evaluation.results_of, self))
    if stop is not None:
      (self.train_actions if stop.condition.split == "train"
       else self.eval_actions).append(stop)
    # best/ and early stopping (`best_metric`), after the stop condition.
    self.best = best.from_config(self, config)
    # Deprecated: run after the train actions, each as `fn(step)`.
    self.on_loop_end = list(on_loop_end)

  @property
  def step(self) -> int:
    return int(self.parts.global_step.numpy())

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
    if not self.saves_after_loop:
      logging.warning("Not saving a checkpoint at step %d: %s", step,
                      self.non_finite_text())
      return None
    self.trainer.sync_replica_state()
    started = time.time()
    path = self.checkpoints.save(step)
    if self.goodput is not None:
      self.goodput.add("checkpoint", time.time() - started)
      if getattr(self.checkpoints, "async_checkpoint", None):
        # Its steps count once the write lands (a kill -9 before that
        # makes them lost); `save` waited for the previous one.
        self._confirm_save()
        self._unlisted = step
      else:
        self.goodput.saved(step)
    return path

  def _confirm_save(self):
    """The steps up to a background write that landed count (goodput)."""
    if self._unlisted is not None and self.goodput is not None:
      self.goodput.saved(self._unlisted)
    self._unlisted = None

  @property
  def loss_finite(self) -> bool:
    """Whether the last loop's watched metrics were finite."""
    return self.report.finite

  @property
  def saves_after_loop(self) -> bool:
    """Whether the weights after the last loop may be saved: its loss was
    finite, or under nan_policy=skip its last step was applied (a skipped
    step changed nothing, so the loop's mean loss counts its NaN and the
    weights do not; a loop that ends in skipped steps may end a diverged
    model's run: not saved)."""
    if self.loss_finite:
      return True
    parts = self.parts
    return (parts.nan_policy == "skip" and parts.consecutive_skips is not None
            and parts.consecutive_skips() == 0)

  def non_finite_text(self, name_checkpoint: bool = True) -> str:
    """What was not finite in the last loop (and the latest checkpoint)."""
    text = self.report.non_finite_text()
    if name_checkpoint:
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
    started = time.time()
    self.trainer.sync_replica_state()
    step = self.step
    self.eval_results = {
        split: evaluation.evaluate_one(self, split, fn, step)
        for split, fn in self.eval_sets.items()}
    if self.goodput is not None:
      self.goodput.add("evaluation", time.time() - started)
    # The actions get the primary set's (eval/, else the first).
    results = next(iter(self.eval_results.values()))
    self.last_eval, self._last_eval_step = results, step
    self._act(self.eval_actions, step, results)
    return results

  def report_profile(self, table: Optional[profiling.OpTable],
                     step: int) -> None:
    """Logs and summarises a profiler window's op table (if any)."""
    report_profile(table, self.config.profile_steps,
                               self.writer, step)

  def wait_for_checkpoint(self) -> None:
    """Waits for a checkpoint written in the background (ModelDirError if
    its write failed)."""
    wait = getattr(self.checkpoints, "wait", None)  # a manager of one's own
    if wait is not None:
      wait()
      self._confirm_save()

  def restore(self) -> None:
    """Restores the latest checkpoint, once (CheckpointError on mismatch)."""
    if not self._restored:
      self.restored_from = self.checkpoints.restore_latest()
      if self.restored_from:
        adapt.refresh(self.parts.model)
      self._restored = True
      self.writer.restart(self.step)  # the steps after it train again

  def run(self) -> Optional[dict]:
    """Trains to `train_steps` (or a stop request), resuming from the latest
    checkpoint; the final evaluation's results (None without eval_input)."""
    c = self.config
    show_progress_by_default()
    if self.handle_preemption and self.preemption is None:
      self.preemption = actions_lib.install(self)
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
    # The steps a killed launch trained past `step` are trained again.
    self.goodput = goodput.Goodput(
        self.model_dir, enabled=strategies.is_chief(self.parts.strategy),
        start_time=self.start_time)
    self.goodput.restored(step)
    self.writer("train").text(step, "flags", markdown_table(self.hparams))
    self.writer("").hparams(self.hparams)  # model_dir: train/, eval/ below.
    iterator = self._train_iterator(step)
    try:
      step, last_saved = self._train_loops(iterator, step)
    finally:
      # A window past the last step, or a run that stopped inside it.
      self.report_profile(self.profiler.maybe_stop(self.step, force=True),
                          self.step)
    if not self.saves_after_loop:
      raise NonFiniteLossError(
          f"{self.non_finite_text()}; the run ended without saving a final "
          "checkpoint or weights: lower learning_rate, set clip_norm, or "
          "train on from the last good checkpoint")
    if last_saved != step:
      self.save(step)
    self.wait_for_checkpoint()  # a background write: listed before the end
    self.targets.record(step, self.last_eval)
    self._train_end(step, None)
    if self._last_eval_step == step and self.last_eval is not None:
      results = self.last_eval  # stopped right after an evaluation
    else:
      results = self.evaluate()
    self.targets.record(step, self.last_eval)
    self.targets.report_missed(step)
    self.goodput.report(step, self.writer)
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
      with self.writer("train").as_default(self.parts.global_step), (
          tf.summary.record_if(record_every(self.config.summary_every))):
        return {k: float(v) for k, v in
                self.trainer.train(iterator, num_steps).items()}
    except tf.errors.InvalidArgumentError as e:
      error = self.batching.train_error(e)
      if error is None:
        raise
      raise error from None

  def _train_iterator(self, step):
    """Batches from `step` on, past the batches rollbacks skipped."""
    skipped = self.rollbacks.skipped
    if not skipped:
      return iter(self.batching.train(self.train_input(step)))
    start = spikes.data_position(step, skipped)
    return iter(self.batching.train(spikes.skip_batches(
        self.train_input(start), start, skipped)))

  def _roll_back(self, spike_step):
    """Restores the last checkpoint after a spike at `spike_step` and
    records the batches since it; (step, iterator), or None before the
    first checkpoint (the spike's update was dropped: a skip)."""
    # A background write in flight is the checkpoint a synchronous run would
    # roll back to: list it first.
    self.wait_for_checkpoint()
    path = self.checkpoints.latest
    # Only the chief lists its checkpoints: every worker restores the one
    # it names (and reads it once the chief has written it).
    saved = strategies.chief_value(
        self.parts.strategy, int(path.rsplit("-", 1)[1]) if path else -1)
    if saved < 0:
      logging.warning(
          "loss spike at step %d: no checkpoint yet to roll back to; its "
          "update was skipped (spikes/skipped)", spike_step)
      return None
    if path is None:  # a worker other than the chief
      path = os.path.join(self.model_dir, f"ckpt-{saved}")
      self.checkpoints.restore_latest(path)
    else:
      self.checkpoints.restore_latest()
    adapt.refresh(self.parts.model)
    step = self.step
    batches = self.rollbacks.add(spike_step, step, write=strategies.is_chief(
        self.parts.strategy))
    logging.warning(
        "loss spike at step %d: rolled back to %s (step %d); batches %s "
        "skipped from now on (%s)", spike_step, path, step,
        spikes.batches_text(batches), self.rollbacks.path)
    self.report.rolled_back_steps = self.rollbacks.rolled_back_steps
    self.writer.restart(step)  # the steps after it train again
    return step, self._train_iterator(step)

  def _spike_skipped(self):
    """Updates the spike policy dropped so far (0 without one)."""
    spikes_ = self.parts.spikes
    return 0 if spikes_ is None else int(spikes_.skipped.numpy())

  def _skipped(self):
    """Steps skipped so far (0 when the trainer does not count them)."""
    count = self.parts.skipped_steps
    return 0 if count is None else count()

  def _train_loops(self, iterator, step):
    """Loops from `step` to `train_steps`; (last step, last saved step)."""
    c = self.config
    last_saved = step
    skipped, spike_skipped = self._skipped(), self._spike_skipped()
    while step < c.train_steps:
      num_steps = steps_to_next_event(
          c, step, self.profiler.boundaries())
      self.profiler.maybe_start(step)
      self.report.before_loop(step, num_steps)
      loop_start = time.time()
      self.goodput.training(loop_start)  # the first loop ends start-up
      metrics = self._train(iterator, num_steps)
      elapsed = time.time() - loop_start
      spike_step = (self.parts.spikes.take_pending()
                    if self.parts.spikes is not None else 0)
      last = self.step
      rolling = time.time()
      rolled = spike_step and self._roll_back(spike_step)
      if rolled:
        # The steps since the checkpoint train again, on other batches; the
        # restore and the new iterator are the rollback's time too.
        self.goodput.loop(step + 1, last, elapsed)
        step, iterator = rolled
        self.goodput.restored(step, "rolled_back")
        self.goodput.add("rolled_back", time.time() - rolling)
        skipped, spike_skipped = self._skipped(), self._spike_skipped()
        continue
      # Fewer steps than asked when the loop was told to stop.
      step, num_steps = self.step, self.step - step
      self.goodput.loop(step - num_steps + 1, step, elapsed)
      skipped, newly_skipped = self._skipped(), skipped
      self.goodput.lost_steps(skipped - newly_skipped, "skipped")
      spike_skipped, before = self._spike_skipped(), spike_skipped
      self.goodput.lost_steps(spike_skipped - before, "spike_skipped")
      self.report.watch(step - num_steps + 1, step, metrics, elapsed)
      outputs = self.report.outputs(metrics, num_steps, elapsed)
      if due(c.summary_every, step) or step == c.train_steps:
        self.writer("train").scalars(step, outputs)
      if due(c.log_every, step) or step == c.train_steps:
        self.report.log(step, metrics, outputs)
      if self.step_times is not None and (
          due(c.summary_every, step) or due(c.log_every, step)):
        # A collective: every worker is at the same step here.
        self.step_times.record(step, num_steps, elapsed,
                               write=due(c.summary_every, step),
                               log=due(c.log_every, step))
      self._act(self.train_actions, step, outputs)
      for fn in self.on_loop_end:
        fn(step)
      if due(c.checkpoint_every, step):
        self.save(step)  # skipped with a warning after a non-finite loss
        last_saved = step if self.saves_after_loop else last_saved
      if (due(c.eval_every, step) and step != c.train_steps
          and step >= c.eval_start_step):
        self.evaluate()
      self.goodput.write()  # what a relaunch knows of this launch
      if self.parts.take_stop_request():  # in the loop or after
        self.request_stop("trainer.request_stop()")
      if self.stop_reason is not None:
        logging.info("run ends at step %d of %d: %s", step, c.train_steps,
                     self.stop_reason)
        break
    return step, last_saved


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
  `averaged_weights()` (a context holding the EMA weights); `spikes` (the
  loss-spike window, `framework.core.spikes`; none: spike_policy=none);
  `collective_wait()` (seconds this task waited in the gradient
  all-reduce so far; none: each worker's step time is not split);
  `throughput` (a `framework.perf.throughput.Throughput`: FLOP/s, MFU and
  tokens/s from examples/s; none: not reported).
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
  spikes: Any = None
  collective_wait: Optional[Callable[[], float]] = None
  throughput: Any = None

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
  if not isinstance(trainer, protocols.LoopTrainer):
    raise ConfigError(
        f"trainer={type(trainer).__name__} lacks "
        f"{', '.join(protocols.missing(trainer, protocols.LoopTrainer))}: a "
        "Controller needs framework.core.protocols.LoopTrainer, or LoopParts "
        "handed to it")
  evaluator = trainer if evaluator is None else evaluator
  optional = protocols.optional
  policy = optional(trainer, "nan_policy")
  skips = [optional(trainer, name) for name in
           ("skipped_steps", "consecutive_skips", "max_skipped_steps")]
  counts = all(value is not None for value in skips)
  skipped = consecutive = max_skipped = None
  if counts and (policy == "skip"
                 or optional(trainer, "loss_scale") is not None):
    skipped = lambda: int(skips[0].numpy())
  if counts and policy == "skip":
    consecutive, max_skipped = lambda: int(skips[1].numpy()), skips[2]
  requested = optional(trainer, "stop_requested")
  wait = optional(trainer, "collective_wait_seconds")
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
      metric_aliases=dict(optional(evaluator, "metric_aliases")),
      model=trainer.model,
      export_model=functools.partial(protocols.export_model, trainer),
      ema=optional(trainer, "ema"),
      averaged_weights=functools.partial(protocols.averaged_weights, trainer),
      spikes=optional(trainer, "spikes"),
      collective_wait=(None if wait is None else
                       lambda: float(wait.numpy())))


def loop_evaluator(trainer: Any, evaluator: Any, needed: bool) -> Any:
  """The evaluator a Controller uses (`evaluator`, else a `LoopEvaluator`
  trainer); ConfigError when `trainer` has no `train` and
  `sync_replica_state`, or when an evaluator is `needed` and there is
  none."""
  lacks = [name for name in ("train", "sync_replica_state")
           if not callable(getattr(trainer, name, None))]
  if lacks:
    raise ConfigError(
        f"trainer={type(trainer).__name__} lacks {', '.join(lacks)}: a "
        "Controller needs framework.core.protocols.LoopTrainer")
  if evaluator is None and isinstance(trainer, protocols.LoopEvaluator):
    evaluator = trainer
  if needed and not isinstance(evaluator, protocols.LoopEvaluator):
    raise ConfigError(
        f"an eval input is set but trainer={type(trainer).__name__} has no "
        "evaluate(distributed_dataset) and no evaluator= was given")
  return evaluator


def watched_metrics(metrics: Mapping[str, Any]) -> dict:
  """The values the NaN policy watches: `loss` if present, else all."""
  if "loss" in metrics:
    return {"loss": metrics["loss"]}
  return dict(metrics)


def _take(requested):
  if requested is None or not bool(requested.numpy()):
    return False
  requested.assign(False)
  return True


# When the loop's events fall: how many steps the next `train` call runs.
#
# Each call runs up to the next event: a summary, log line, checkpoint or
# evaluation interval (`LoopConfig.*_every`), a profiler window's boundary,
# or `train_steps`, and at most `steps_per_loop` steps (an int, or Orbit's
# function of the global step, e.g. `lambda step: 10 if step < 100 else
# 1000`; what it returns is checked each loop).
def due(every: int, step: int) -> bool:
  """Whether an interval of `every` steps (0: never) ends at `step`."""
  return bool(every) and step % every == 0


def steps_per_loop(config: Any, step: int) -> int:
  """`steps_per_loop`, or what it returns for `step` if it is callable."""
  every = config.steps_per_loop
  steps = every(step) if callable(every) else every
  if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
    raise ConfigError(f"steps_per_loop({step}) returned {steps!r}; it must "
                      "return an integer >= 1")
  return steps


def steps_to_next_event(config: Any, step: int,
                        boundaries: Sequence[int] = ()) -> int:
  """The steps from `step` to the next event (`boundaries`: the profiler
  window's)."""
  candidates = [steps_per_loop(config, step), config.train_steps - step]
  for every in (config.checkpoint_every, config.eval_every,
                config.summary_every, config.log_every):
    if every:
      candidates.append(every - step % every)
  candidates += [b - step for b in boundaries if b > step]
  return min(candidates)


# What each training loop reports: its outputs, its log lines, and what
# was not finite in it.
#
# A loop's outputs are the trainer's mean metrics plus `learning_rate`,
# `steps_per_second`, `examples_per_second` (with a `global_batch_size`),
# `perf/flops_per_sec`, `perf/mfu` and `perf/tokens_per_sec` (with a
# `throughput` too) and `skipped_steps` (a trainer that counts skipped
# steps and skips them: nan_policy=skip or float16 loss scaling); they are
# what the train actions get and what `train/` summarises. The log line puts `loss` first and counts the ETA to
# `train_steps`.
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
    parts: the run's `LoopParts` (its `optimizer`, `global_batch_size`
      and skip count).
    train_steps: where the run ends (the ETA's end).
    stop_condition: the run's condition, or None (said in the first line).
  """

  def __init__(self, parts: LoopParts, train_steps: int,
               stop_condition: Any = None):
    self.parts = parts
    self.train_steps = train_steps
    self.stop_condition = stop_condition
    self.global_batch_size = parts.global_batch_size
    self._start = None
    # Whether the last loop's watched metrics were finite (the restored
    # state counts as finite), and that loop (first, last, watched).
    self.finite = True
    self.last_loop = None
    # Steps undone by loss-spike rollbacks, over the run's launches.
    self.rolled_back_steps = 0

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
    watched = watched_metrics(metrics)
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
    if self.parts.optimizer is not None:
      outputs["learning_rate"] = learning_rate(self.parts.optimizer)
    outputs["steps_per_second"] = num_steps / elapsed
    if self.global_batch_size is not None:
      outputs["examples_per_second"] = (
          num_steps * self.global_batch_size / elapsed)
      if self.parts.throughput is not None:
        outputs.update(self.parts.throughput.outputs(
            outputs["examples_per_second"]))
    if self.parts.skipped_steps is not None:
      outputs["skipped_steps"] = float(self.parts.skipped_steps())
    if self.parts.spikes is not None:
      outputs["spikes/skipped"] = float(self.parts.spikes.skipped.numpy())
      outputs["spikes/rolled_back"] = float(self.rolled_back_steps)
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
         f" steps/s={outputs['steps_per_second']:.2f}")
        + throughput.text(outputs),
        format_seconds(eta), f"to step {self.train_steps}",
        (f" skipped_steps={int(outputs['skipped_steps'])}"
         if "skipped_steps" in outputs else "") + (
             f" spikes skipped={int(outputs['spikes/skipped'])} rolled_back="
             f"{int(outputs['spikes/rolled_back'])}"
             if "spikes/skipped" in outputs else ""))


def report_profile(table: Any, profile_steps: Any, writer: Any,
                   step: int) -> None:
  """Logs a profiler window's op table and writes it to `train/` (if any)."""
  if table is None:
    return
  first, last = profile_steps
  logging.info("profile of steps %d..%d (trace: %s):\n%s", first, last,
               table.trace_path, table.markdown(top=10))
  writer("train").text(step, "profile/op_time", table.markdown())


# Progress lines (absl INFO) visible from a plain Python process.
#
# Under an absl app (`scripts/train.py`), `--verbosity`/`--logtostderr`
# decide. From a plain `python` process absl shows only warnings, so the
# Controller's progress lines (`train step ...`, `eval step ...`) would be
# silent: `Controller.run()` turns INFO on there, once, unless the user
# configured logging (absl's verbosity, or a handler on the root logger).
# `enable_logging()` does it explicitly, at any level.
_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO,
           "warning": logging.WARNING, "error": logging.ERROR}


def enable_logging(level: Union[str, int] = "info") -> None:
  """Shows distloop's (absl) log lines at `level` and above on stderr."""
  if isinstance(level, str):
    if level.lower() not in _LEVELS:
      from framework.errors import ConfigError  # pylint: disable=g-import-not-at-top
      raise ConfigError(f"level={level!r} must be one of "
                        f"{', '.join(_LEVELS)} (or an absl level number)")
    level = _LEVELS[level.lower()]
  logging.set_verbosity(level)


def user_configured_logging() -> bool:
  """Whether someone chose how logs show: an absl app's flags, absl's
  verbosity, or Python logging's root handlers or level."""
  root = std_logging.getLogger()
  return (flags.FLAGS.is_parsed()
          or logging.get_absl_logger().level != std_logging.NOTSET
          or any(not isinstance(h, logging.ABSLHandler)
                 for h in root.handlers)
          or root.level != std_logging.WARNING)


def show_progress_by_default() -> None:
  """INFO from a plain Python process where nobody configured logging."""
  if not user_configured_logging():
    enable_logging("info")
