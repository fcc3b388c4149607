"""The outer loop: steps, checkpoints, summaries, evaluation and actions.

    restore the latest checkpoint (model, optimizer, global step)
    iterator = batches from the restored step on
    while step < train_steps:
      n = steps to the next event (summary, log, checkpoint, eval, end),
          at most steps_per_loop
      outputs = trainer.train(iterator, n)      # n steps in one graph call
                                                # (fewer when asked to stop);
                                                # tf.summary calls inside the
                                                # step go to train/
      write summaries / log when their interval is reached
      train actions(step, outputs)              # NaN policy, stop_when,
                                                # profiler, preemption, yours
      save / evaluate (+ eval actions) when their interval is reached
      end here if an action asked to stop
    save and evaluate at the end

The trainer owns the math of a step (`framework.core.protocols` says what
the Controller reads of it); this class owns everything around it.
"""

import math
import os
import re
import time
from typing import Any, Callable, Optional, Sequence

from absl import logging
import keras
import tensorflow as tf

from framework import _tf_internal
from framework.data import integrity, preprocessing
from framework.distribute import strategies
from framework.perf import profiling
from framework.core import run_state
from framework.core import actions as actions_lib
from framework.core import best_checkpoint
from framework.core import eval_sets as eval_sets_lib
from framework.core import metric_sinks as metric_sinks_lib
from framework.core import progress
from framework.core import protocols
from framework.core.checkpointing import CheckpointManager
from framework.core.config import LoopConfig  # pylint: disable=unused-import
from framework.data.inputs import MaskedBatch, pad_batches
from framework.errors import (ConfigError, DataError,
                              NonFiniteLossError)
from framework.core.summaries import SummaryWriter, markdown_table


def learning_rate(optimizer: keras.optimizers.Optimizer) -> float:
  """The optimizer's current learning rate as a float, whatever it holds: a
  constant, a (mirrored) variable, or a schedule evaluated at its step."""
  return float(keras.ops.convert_to_numpy(optimizer.learning_rate))


_PARTIAL = "distloop_partial_batch"


def _check_batch_size(dataset, global_batch_size):
  """`dataset` with every batch's leading dimension checked against
  `global_batch_size` (DataError now if it is known to differ)."""
  dims = {t.shape[0] if t.shape.rank else None
          for t in tf.nest.flatten(dataset.element_spec)}
  if dims == {global_batch_size}:
    return dataset
  if None not in dims:
    raise DataError(
        f"train_input gives batches of {sorted(dims)[0]} examples; every "
        f"training batch must have global_batch_size={global_batch_size} "
        "examples (batch with drop_remainder=True)")

  def check(*batch):
    flat = tf.nest.flatten(batch)
    size = tf.shape(flat[0])[0]
    with tf.control_dependencies([tf.debugging.Assert(
        tf.equal(size, global_batch_size), [_PARTIAL, size])]):
      return tf.nest.map_structure(tf.identity, batch if len(batch) > 1
                                   else batch[0])

  return dataset.map(check)


def _partial_batch_error(error, global_batch_size):
  """The DataError for a failed `_check_batch_size` assertion, else None."""
  if _PARTIAL not in str(error):
    return None
  size = re.search(_PARTIAL + r"\W*(\d+)", str(error))
  return DataError(
      f"train_input gave a batch of {size.group(1) if size else 'another'} "
      f"examples; every training batch must have global_batch_size="
      f"{global_batch_size} examples (a partial batch would be averaged over "
      "the wrong count: repeat() before batch(), or drop_remainder=True)")


def _format_seconds(seconds):
  seconds = int(seconds)
  return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Controller:
  """Runs a trainer for `config.train_steps` with checkpoints and summaries.

  The trainer: a `framework.Trainer` (or subclass), or any object that
  implements `framework.core.protocols.LoopTrainer` (and `LoopEvaluator`
  to evaluate); the Controller reads nothing else of it:

      model: keras.Model                    # checkpointed
      optimizer: keras.optimizers.Optimizer # checkpointed; rate logged
      strategy: tf.distribute.Strategy
      global_step: tf.Variable              # int64, advanced by the steps
      train(iterator, num_steps) -> {name: scalar}  # the mean of the steps
                                                    # that ran; any names
      sync_replica_state() -> None          # may do nothing
      evaluate(distributed_dataset) -> {name: float}  # LoopEvaluator

  Optional, each its own protocol there (default when absent):
  `global_batch_size` (no batch check, no examples/s), `nan_policy`
  ("stop"), the skip counters (no skipped-step limit), `request_stop` /
  `stop_requested` (no in-graph stop), `distribute_dataset` (the
  strategy's). Every returned metric is logged and summarised under its own
  name; the NaN policy watches `loss` if the trainer returns one, else every
  returned value.

  Input contract:
    train_input(start_step) returns endless global batches for steps
    `start_step, start_step + 1, ...`: skipping what the run already
    consumed is the function's job (a restored run calls it with the
    restored step; the framework never skips), e.g.
    `lambda start_step: ds.repeat().batch(64, drop_remainder=True)
    .skip(start_step)` for a deterministic `ds`. It returns either a
    `tf.data.Dataset` whose elements are whole global batches (leading
    dimension `global_batch_size`, split over the replicas with
    `strategy.experimental_distribute_dataset`), or an already distributed
    dataset or iterator (e.g. from `distribute_datasets_from_function`),
    used as is. A batch of another size is a `DataError` (before training
    if the dataset's static shape shows it, else when the batch comes), not
    a loss averaged over the wrong count.

    eval_input() returns one pass over the eval set, as a `tf.data.Dataset`
    of batches (the last one may be partial: for a `Trainer` the framework
    re-batches it to `global_batch_size`, pads the last batch with masked
    rows, see `framework.data.inputs.pad_batches`, and distributes it, so
    that every replica gets a full batch) or an already distributed dataset
    (used as is: pad it yourself). `eval_inputs={"test": fn, ...}` adds
    more named sets, each evaluated at every evaluation into
    `model_dir/eval_<name>` (`framework.core.eval_sets`).

  Actions (`framework.core.actions`): `fn(step, outputs)`. Train actions
  run after each loop's summaries and log line, before its checkpoint and
  evaluation, with the loop's outputs; eval actions after each evaluation,
  with its results. `request_stop(reason)` (from an action or another
  thread) ends the run after the current loop's events with the same
  artifacts as a normal end: a final checkpoint and evaluation.

  Summaries from inside the step: `tf.summary.*` calls in the trainer's
  step are written to `model_dir/train` at the step they ran in, on the
  steps that `summary_every` divides (`framework.Trainer` records the step
  a step ends at; another trainer records `global_step` as it reads it);
  in the evaluator's step, to `model_dir/eval` at the evaluated step.

  Progress: from a plain Python process where nobody configured logging,
  `run()` turns absl's INFO on so the progress lines show
  (`framework.core.progress`; `framework.enable_logging(level)` sets it).

  Args:
    trainer: a `LoopTrainer` (e.g. `framework.Trainer`).
    config: a `LoopConfig`.
    model_dir: checkpoints here; TensorBoard in `train/` and `eval/`.
    train_input: `start_step -> dataset` of global batches (see above).
    eval_input: `() -> dataset` over the whole eval set, or None.
    eval_inputs: {name: `() -> dataset`}: more eval sets (`eval_<name>/`;
      the name `eval` is `eval_input`'s).
    hparams: a dict (e.g. the run's flags) written as a text summary and
      to TensorBoard's HParams dashboard (`model_dir` is the session).
    checkpoint_items: extra trackables to checkpoint besides model,
      optimizer and global step.
    train_actions: callables `fn(step, outputs)` run after each loop, after
      the built-in ones (NaN policy, profiler report); more can be appended
      to `self.train_actions`.
    eval_actions: callables `fn(step, results)` run after each evaluation;
      `self.eval_actions` likewise.
    evaluator: a `LoopEvaluator` (default: the trainer).
    on_loop_end: deprecated: callables `fn(step)`, run as train actions.
    metric_sinks: more `framework.core.summaries.MetricSink`s for every
      scalar point, besides TensorBoard and `model_dir/metrics.jsonl`
      (`self.metric_sinks`; chief only).
    `self.on_train_end`: callables `fn(step)` run once training is over and
      its final checkpoint saved, before the final evaluation (e.g. what a
      preemption then does).

  A run that stopped at `stop_at_accuracy` is finished: relaunched with
  the same settings it trains nothing (see `framework/core/run_state.py`).

  Time to target (`config.stop_when` / `stop_at_accuracy`): `time_to_target`
  is the wall time from `start_time` to the end of the first evaluation (or
  loop, for a train/ condition) that meets the condition: everything in
  between counts (building the input pipeline, tracing, every step, every
  evaluation, checkpoints and summaries). `start_time` defaults to the
  start of `run()`; `experiment.run` sets it to its own start, so loading
  the dataset and building the model count too. A resumed run counts from
  its own start.
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
    if not isinstance(trainer, protocols.LoopTrainer):
      missing = [name for name in ("model", "optimizer", "strategy",
                                   "global_step", "train",
                                   "sync_replica_state")
                 if not hasattr(trainer, name)]
      raise ConfigError(
          f"trainer={type(trainer).__name__} lacks {', '.join(missing)}: a "
          "Controller needs framework.core.protocols.LoopTrainer")
    if evaluator is None and isinstance(trainer, protocols.LoopEvaluator):
      evaluator = trainer
    # {split: input}: eval/ first, then eval_<name>/ for each named set.
    self.eval_sets = eval_sets_lib.collect(eval_input, eval_inputs)
    if self.eval_sets and not isinstance(
        evaluator, protocols.LoopEvaluator):
      raise ConfigError(
          f"an eval input is set but trainer={type(trainer).__name__} has no "
          "evaluate(distributed_dataset) and no evaluator= was given")
    self.trainer = trainer
    self.evaluator = evaluator
    self.config = config
    # Absolute once, here: checkpoints, summaries and the profiler join paths
    # onto it, and TensorFlow joins a relative one twice.
    if "://" not in model_dir:
      model_dir = os.path.abspath(model_dir)
    self.model_dir = model_dir
    self.train_input = train_input
    self.eval_input = eval_input
    self._said_scaled = False
    self.hparams = hparams or {}
    chief = strategies.is_chief(trainer.strategy)
    # Dropout's random state too, so that a resumed run draws the same masks.
    rng_states = [v for v in trainer.model.variables
                  if _tf_internal.is_seed_generator_state(v)]
    items = dict(checkpoint_items or {})
    if rng_states:
      items["rng_states"] = rng_states
    self.checkpoint = tf.train.Checkpoint(
        model=trainer.model,
        optimizer=protocols.checkpointed_optimizer(trainer),
        global_step=trainer.global_step, **items)
    self.checkpoints = CheckpointManager(
        self.checkpoint, model_dir, trainer.strategy,
        max_to_keep=config.keep_checkpoints)
    self._chief = chief
    self._writers = {}
    # Every scalar also goes to model_dir/metrics.jsonl and these sinks.
    self.metric_sinks = [metric_sinks_lib.JsonlSink(os.path.join(
        model_dir, metric_sinks_lib.METRICS_FILE)), *metric_sinks] if (
            chief) else []
    self._restored = False
    self.restored_from = None  # the checkpoint restore() restored, if any
    # Whether the last loop's watched metrics were finite: a loop that was
    # not saves no checkpoint (the restored state counts as finite).
    self.loss_finite = True
    self._last_loop = None
    self.last_eval = None
    self.eval_results = {}  # {split: results} of the latest evaluation
    self.on_train_end = []
    self._last_eval_step = None
    self.stop_reason = None
    self.start_time = None
    self.steps_per_epoch = None  # if known: best.json's epoch
    self.time_to_target = None
    self.measure_target = True
    # The chief traces; other workers run the same ops.
    self.profiler = profiling.StepProfiler(
        config.profile_steps if chief else (),
        os.path.join(model_dir, "train"))
    self.train_actions = [actions_lib.NanGuard(self),
                          actions_lib.ProfileReport(self),
                          *train_actions]
    self.eval_actions = list(eval_actions)
    condition = config.stop_condition()
    if condition is not None:
      stop = actions_lib.StopWhen(
          self, condition, description=(
              f"accuracy {config.stop_at_accuracy:.4f}"
              if config.stop_when is None else None))
      (self.train_actions if condition.split == "train"
       else self.eval_actions).append(stop)
    # best/ and early stopping (`best_metric`), after the stop condition.
    self.best = best_checkpoint.from_config(self, config)
    # Deprecated: run after the train actions, each as `fn(step)`.
    self.on_loop_end = list(on_loop_end)

  def writer(self, name: str) -> SummaryWriter:
    """The SummaryWriter for `model_dir/<name>`, created on first use (so a
    run that fails while restoring leaves no new event files)."""
    if name not in self._writers:
      self._writers[name] = SummaryWriter(self.model_dir, name,
                                          enabled=self._chief,
                                          sinks=self.metric_sinks)
    return self._writers[name]

  @property
  def step(self) -> int:
    return int(self.trainer.global_step.numpy())

  def request_stop(self, reason: str = "requested") -> None:
    """Ends the run after the current loop's checkpoint and evaluation, as
    at `train_steps` (final checkpoint and evaluation). Under a
    multi-worker strategy every worker must ask at the same loop (an
    action deciding on eval results, which all workers share, does)."""
    if self.stop_reason is None:
      self.stop_reason = reason
      logging.info("stop requested (%s): ending the run after this loop",
                   reason)

  def _steps_to_next_event(self, step):
    c = self.config
    candidates = [self._steps_per_loop(step), c.train_steps - step]
    for every in (c.checkpoint_every, c.eval_every, c.summary_every,
                  c.log_every):
      if every:
        candidates.append(every - step % every)
    candidates += [b - step for b in self.profiler.boundaries() if b > step]
    return min(candidates)

  def _steps_per_loop(self, step):
    """`steps_per_loop`, or what it returns for `step` if it is callable."""
    every = self.config.steps_per_loop
    steps = every(step) if callable(every) else every
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
      raise ConfigError(f"steps_per_loop({step}) returned {steps!r}; it must "
                        "return an integer >= 1")
    return steps

  def _due(self, every, step):
    return bool(every) and step % every == 0

  def save(self, step: int) -> Optional[str]:
    """Checkpoints at `step` (every worker must call it); returns the path,
    or None without saving when the last loop's loss was not finite."""
    if not self.loss_finite:
      logging.warning("Not saving a checkpoint at step %d: %s", step,
                      self.non_finite_text())
      return None
    self.trainer.sync_replica_state()
    return self.checkpoints.save(step)

  def non_finite_text(self, checkpoint: bool = True) -> str:
    """What was not finite in the last loop (and the latest checkpoint)."""
    first, last, watched = self._last_loop
    bad = ", ".join(f"{k} is {v}" for k, v in sorted(watched.items())
                    if not math.isfinite(v))
    text = f"{bad} in steps {first}..{last}"
    if checkpoint:
      text += (f" (latest good checkpoint: "
               f"{self.checkpoints.latest or 'none'})")
    return text

  def evaluate(self) -> Optional[dict]:
    """Evaluates every eval set, writes `eval/` (`eval_<name>/`) summaries (with
    `elapsed_seconds`, the wall time since `start_time`, once `run()` set
    it) and runs the eval actions.

    A Controller that has not restored yet (a fresh one) restores the
    latest checkpoint first if there is one; without one it evaluates the
    weights the model holds, at the current `global_step` (Orbit's
    semantics: a baseline before training, a model built in Python).
    """
    if not self.eval_sets:
      return None
    if not self._restored:
      self.restore()
    self.trainer.sync_replica_state()
    step = self.step
    self.eval_results = {
        split: eval_sets_lib.evaluate_one(self, split, fn, step)
        for split, fn in self.eval_sets.items()}
    # The actions get the primary set's (eval/, else the first).
    results = next(iter(self.eval_results.values()))
    self.last_eval, self._last_eval_step = results, step
    for action in self.eval_actions:
      action(step, results)
    return results

  def report_profile(self, table: Optional[profiling.OpTable],
                     step: int) -> None:
    """Logs and summarises a profiler window's op table (if any)."""
    if table is None:
      return
    first, last = self.config.profile_steps
    logging.info("profile of steps %d..%d (trace: %s):\n%s", first, last,
                 table.trace_path, table.markdown(top=10))
    self.writer("train").text(step, "profile/op_time", table.markdown())

  def restore(self) -> None:
    """Restores the latest checkpoint, once (CheckpointError on mismatch)."""
    if not self._restored:
      self.restored_from = self.checkpoints.restore_latest()
      self._restored = True
      for sink in self.metric_sinks:  # the steps after it are trained again
        if hasattr(sink, "restart"):
          sink.restart(self.step)

  def run(self) -> Optional[dict]:
    """Trains to `train_steps` (or a stop request), resuming from the latest
    checkpoint; the final evaluation's results (None without eval_input)."""
    c = self.config
    progress.show_progress_by_default()
    if self.start_time is None:
      self.start_time = time.time()
    self.restore()
    step = self.step
    record = run_state.read_target(self.model_dir)
    if run_state.finished_at_target(record, step, c.train_steps,
                                    c.stop_at_accuracy):
      logging.info(
          "Already finished: accuracy %.4f reached stop_at_accuracy=%.4f at "
          "step %d (%s); nothing to train (raise train_steps or the target "
          "to continue)", record["accuracy"], c.stop_at_accuracy, step,
          run_state.TARGET_FILE)
      self.last_eval = record.get("metrics") or None
      for fn in self.on_train_end:
        fn(step)
      return self.last_eval
    if self.best is not None and self.best.finished(step):
      for fn in self.on_train_end:
        fn(step)
      return self.last_eval
    if run_state.continues_past_target(record, step, c.stop_at_accuracy):
      # More steps for a run that met its target: train them, keep the
      # first time to target (the record stays as it is).
      self.measure_target = False
      logging.info(
          "accuracy %.4f reached stop_at_accuracy=%.4f at step %d "
          "(time_to_target_seconds=%.1f, kept in %s); training on to step "
          "%d without stopping at that target again (a higher "
          "stop_at_accuracy is a new target)", record["accuracy"],
          c.stop_at_accuracy, int(record["step"]),
          float(record.get("time_to_target_seconds", float("nan"))),
          run_state.TARGET_FILE, c.train_steps)
    elif record is not None and self._chief:
      run_state.forget_target(self.model_dir)  # it trains on from here
    if step >= c.train_steps:
      logging.info("Already at step %d of %d; nothing to train", step,
                   c.train_steps)
      self.measure_target = False  # it was measured (or not) when trained
      for fn in self.on_train_end:
        fn(step)
      return self.evaluate()
    self.writer("train").text(step, "flags", markdown_table(self.hparams))
    self.writer("").hparams(self.hparams)  # model_dir: train/, eval/ below.
    iterator = iter(self._distribute_train(self.train_input(step)))
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
    self._record_target(step)
    for fn in self.on_train_end:
      fn(step)
    if self._last_eval_step == step and self.last_eval is not None:
      results = self.last_eval  # stopped right after an evaluation
    else:
      results = self.evaluate()
    self._record_target(step)
    condition = c.stop_condition()
    if (condition is not None and self.time_to_target is None
        and self.measure_target):
      logging.info("target %s not reached in %d steps",
                   f"accuracy {c.stop_at_accuracy:.4f}"
                   if c.stop_when is None else condition, step)
    return results

  def _record_target(self, step):
    """The chief records a reached target beside the checkpoint at `step`."""
    results = self.last_eval
    if (self.time_to_target is None or not self._chief or results is None
        or self.config.stop_at_accuracy is None):
      return
    run_state.record_target(
        self.model_dir, step=step,
        stop_at_accuracy=self.config.stop_at_accuracy,
        accuracy=results.get("accuracy", results.get("pixel_accuracy")),
        train_steps=self.config.train_steps,
        time_to_target=self.time_to_target, metrics=results)

  def _distribute_train(self, data):
    """A plain dataset from `train_input`, checked and distributed."""
    if not isinstance(data, tf.data.Dataset):
      return data
    if isinstance(self.trainer, protocols.BatchSized):
      data = _check_batch_size(data, self.trainer.global_batch_size)
    return self._distribute(data)

  def _pad_eval(self, data):
    """A plain eval dataset re-batched to the trainer's global batch, the
    last batch padded (`MaskedBatch`), for trainers that take masks."""
    evaluator = self.evaluator
    if (not isinstance(evaluator, protocols.MaskedEvaluator)
        or isinstance(data.element_spec, MaskedBatch)):
      return data
    batch_size = evaluator.global_batch_size
    return pad_batches(data.rebatch(batch_size), batch_size)

  def _distribute(self, data):
    """The trainer's `distribute_dataset` if it has one (a parameter-server
    coordinator evaluates plain datasets itself), else the strategy's;
    uint8 features scaled first (`framework.data.preprocessing`)."""
    if preprocessing.has_uint8_features(data.element_spec):
      if not self._said_scaled:
        logging.info("the input gives uint8 features: scaled to float32 in "
                     "[0, 1] before the model (the preprocessing contract, "
                     "as for the built-in datasets)")
        self._said_scaled = True
      data = preprocessing.scale_dataset(data)
    if isinstance(self.trainer, protocols.DatasetDistributing):
      return self.trainer.distribute_dataset(data)
    return self.trainer.strategy.experimental_distribute_dataset(data)

  def _record_step_summaries(self):
    """Whether a tf.summary call inside the step records (read in-graph,
    at the step's default summary step)."""
    every = self.config.summary_every
    if not every:
      return False
    step = tf.summary.experimental.get_step()
    return tf.equal(tf.math.floormod(tf.cast(step, tf.int64), every), 0)

  def _train(self, iterator, num_steps):
    """`trainer.train` as floats; a partial batch becomes a DataError."""
    try:
      with self.writer("train").as_default(self.trainer.global_step), (
          tf.summary.record_if(self._record_step_summaries)):
        return {k: float(v) for k, v in
                self.trainer.train(iterator, num_steps).items()}
    except tf.errors.InvalidArgumentError as e:
      # A damaged shard or record (framework/data/integrity.py) first.
      error = integrity.data_error(e) or _partial_batch_error(
          e, self.trainer.global_batch_size
          if isinstance(self.trainer, protocols.BatchSized) else None)
      if error is None:
        raise
      raise error from None

  def _stop_requested_in_trainer(self):
    """Whether `trainer.request_stop()` was called; clears it, so that the
    trainer's later calls run their steps again."""
    trainer = self.trainer
    if not isinstance(trainer, protocols.Stoppable):
      return False
    if not bool(trainer.stop_requested.numpy()):
      return False
    trainer.stop_requested.assign(False)
    return True

  def _loop_outputs(self, metrics, num_steps, elapsed):
    """The loop's metrics plus learning rate, speed and skipped steps."""
    trainer = self.trainer
    outputs = dict(metrics)
    outputs["learning_rate"] = learning_rate(trainer.optimizer)
    outputs["steps_per_second"] = num_steps / elapsed
    if isinstance(trainer, protocols.BatchSized):
      outputs["examples_per_second"] = (
          num_steps * trainer.global_batch_size / elapsed)
    if isinstance(trainer, protocols.SkipCounting) and (
        protocols.nan_policy(trainer) == "skip"
        or trainer.loss_scale is not None):
      outputs["skipped_steps"] = float(trainer.skipped_steps.numpy())
    return outputs

  def _train_loops(self, iterator, step):
    """Loops from `step` to `train_steps`; (last step, last saved step)."""
    c = self.config
    last_saved = start_step = step
    start_time = time.time()
    first = True
    while step < c.train_steps:
      num_steps = self._steps_to_next_event(step)
      self.profiler.maybe_start(step)
      if first:
        # Nothing else prints while the step function is traced.
        logging.info(
            "training steps %d..%d (the ETA counts to step %d%s); the first "
            "loop (%d steps) includes tracing the train step", step + 1,
            c.train_steps, c.train_steps,
            "" if c.stop_condition() is None else
            ", train_steps: the stop condition may end the run earlier",
            num_steps)
      loop_start = time.time()
      metrics = self._train(iterator, num_steps)
      elapsed = time.time() - loop_start
      if first:
        logging.info("first loop done in %.1f s (tracing included)", elapsed)
        first = False
      # Fewer steps than asked when the loop was told to stop.
      step, num_steps = self.step, self.step - step
      watched = protocols.watched_metrics(metrics)
      self.loss_finite = all(math.isfinite(v) for v in watched.values())
      self._last_loop = (step - num_steps + 1, step, watched)
      outputs = self._loop_outputs(metrics, num_steps, elapsed)
      if self._due(c.summary_every, step) or step == c.train_steps:
        self.writer("train").scalars(step, outputs)
      if self._due(c.log_every, step) or step == c.train_steps:
        rate = (step - start_step) / max(time.time() - start_time, 1e-9)
        eta = (c.train_steps - step) / max(rate, 1e-9)
        logging.info(
            "train step %d/%d: %s%s ETA %s %s%s", step, c.train_steps,
            " ".join(f"{k}={v:.4f}" for k, v in
                     sorted(metrics.items(), key=lambda kv: kv[0] != "loss")),
            (f" examples/s={outputs['examples_per_second']:.1f}"
             if "examples_per_second" in outputs else
             f" steps/s={outputs['steps_per_second']:.2f}"),
            _format_seconds(eta), f"to step {c.train_steps}",
            f" skipped_steps={int(outputs['skipped_steps'])}"
            if "skipped_steps" in outputs else "")
      for action in self.train_actions:
        action(step, outputs)
      for fn in self.on_loop_end:
        fn(step)
      if self._due(c.checkpoint_every, step):
        self.save(step)  # skipped with a warning after a non-finite loss
        last_saved = step if self.loss_finite else last_saved
      if (self._due(c.eval_every, step) and step != c.train_steps
          and step >= c.eval_start_step):
        self.evaluate()
      if self._stop_requested_in_trainer():  # during the loop or after it
        self.request_stop("trainer.request_stop()")
      if self.stop_reason is not None:
        logging.info("run ends at step %d of %d: %s", step, c.train_steps,
                     self.stop_reason)
        break
    return step, last_saved
