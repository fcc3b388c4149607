"""The outer loop: steps, checkpoints, summaries, evaluation and progress.

    restore the latest checkpoint (model, optimizer, global step)
    iterator = batches from the restored step on
    while step < train_steps:
      n = steps to the next event (summary, log, checkpoint, eval, end),
          at most steps_per_loop
      metrics = trainer.train(iterator, n)      # n steps in one graph call
                                                # (fewer when asked to stop)
      stop if the loss is not finite, or under nan_policy=skip after
          max_skipped_steps skipped steps in a row (nothing saved)
      write summaries / log / save / evaluate when their interval is reached
    save and evaluate at the end

The trainer owns the math of a step; this class owns everything around it.
"""

import math
import os
import re
import time

from absl import logging
import keras
import tensorflow as tf

from framework.data import integrity
from framework.distribute import strategies
from framework.perf import profiling
from framework.core import run_state
from framework.core.checkpointing import CheckpointManager
from framework.core.config import LoopConfig  # pylint: disable=unused-import
from framework.data.inputs import MaskedBatch, pad_batches
from framework.errors import (CheckpointError, ConfigError, DataError,
                              NonFiniteLossError)
from framework.core.summaries import SummaryWriter, markdown_table


def learning_rate(optimizer):
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
  """Runs a Trainer for `config.train_steps` with checkpoints and summaries.

  The trainer: a `framework.Trainer` (or subclass), or any object with
  `model`, `optimizer` (any Keras optimizer: constant, variable or schedule
  learning rate), `strategy`, `global_step` (an int64 variable the steps
  advance), `train(iterator, n) -> dict of scalars` (the mean of `n` steps;
  every entry is logged and summarised under its own name),
  `evaluate(distributed_dataset) -> dict of floats`, `sync_replica_state()`
  (may do nothing), and `global_batch_size` and `nan_policy` as Trainer's.

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
    (used as is: pad it yourself).

  Args:
    trainer: a `framework.Trainer` (or an object as above).
    config: a `LoopConfig`.
    model_dir: checkpoints here; TensorBoard in `train/` and `eval/`.
    train_input: `start_step -> dataset` of global batches (see above).
    eval_input: `() -> dataset` over the whole eval set, or None.
    hparams: a dict (e.g. the run's flags) written as a text summary and
      to TensorBoard's HParams dashboard (`model_dir` is the session).
    checkpoint_items: extra trackables to checkpoint besides model,
      optimizer and global step.
    on_loop_end: callables `fn(step)` run after each loop's events (e.g.
      preemption checks); more can be appended to `self.on_loop_end`.
    `self.on_train_end`: callables `fn(step)` run once training is over and
      its final checkpoint saved, before the final evaluation (e.g. what a
      preemption then does).

  A run that stopped at `stop_at_accuracy` is finished: relaunched with
  the same settings it trains nothing (see `framework/core/run_state.py`).

  Time to target (`config.stop_at_accuracy`): `time_to_target` is the wall
  time from `start_time` to the end of the first evaluation that reaches
  the target: everything in between counts (building the input pipeline,
  tracing, every step, every evaluation, checkpoints and summaries).
  `start_time` defaults to the start of `run()`; `experiment.run` sets it
  to its own start, so loading the dataset and building the model count
  too. A resumed run counts from its own start.
  """

  def __init__(self, trainer, config, model_dir, *, train_input,
               eval_input=None, hparams=None, checkpoint_items=None,
               on_loop_end=()):
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
    # Dropout's random state too, so that a resumed run draws the same masks.
    rng_states = [v for v in trainer.model.variables
                  if v.name == "seed_generator_state"]
    items = dict(checkpoint_items or {})
    if rng_states:
      items["rng_states"] = rng_states
    self.checkpoint = tf.train.Checkpoint(
        model=trainer.model, optimizer=trainer.optimizer,
        global_step=trainer.global_step, **items)
    self.checkpoints = CheckpointManager(
        self.checkpoint, model_dir, trainer.strategy,
        max_to_keep=config.keep_checkpoints)
    self._chief = chief
    self._writers = {}
    self._restored = False
    self.restored_from = None  # the checkpoint restore() restored, if any
    # Whether the last loop's loss was finite: a loop that was not saves no
    # checkpoint (the restored state counts as finite).
    self.loss_finite = True
    self._last_loop = None
    self.last_eval = None
    self.on_loop_end = list(on_loop_end)
    self.on_train_end = []
    self.start_time = None
    self.time_to_target = None
    self._measure_target = True
    # The chief traces; other workers run the same ops.
    self.profiler = profiling.StepProfiler(
        config.profile_steps if chief else (),
        os.path.join(model_dir, "train"))

  def writer(self, name):
    """The SummaryWriter for `model_dir/<name>`, created on first use (so a
    run that fails while restoring leaves no new event files)."""
    if name not in self._writers:
      self._writers[name] = SummaryWriter(self.model_dir, name,
                                          enabled=self._chief)
    return self._writers[name]

  @property
  def step(self):
    return int(self.trainer.global_step.numpy())

  def _steps_to_next_event(self, step):
    c = self.config
    candidates = [c.steps_per_loop, c.train_steps - step]
    for every in (c.checkpoint_every, c.eval_every, c.summary_every,
                  c.log_every):
      if every:
        candidates.append(every - step % every)
    candidates += [b - step for b in self.profiler.boundaries() if b > step]
    return min(candidates)

  def _due(self, every, step):
    return bool(every) and step % every == 0

  def save(self, step):
    """Checkpoints at `step` (every worker must call it); returns the path,
    or None without saving when the last loop's loss was not finite."""
    if not self.loss_finite:
      logging.warning("Not saving a checkpoint at step %d: %s", step,
                      self._non_finite_text())
      return None
    self.trainer.sync_replica_state()
    return self.checkpoints.save(step)

  def _non_finite_text(self):
    first, last, loss = self._last_loop
    return (f"loss is {loss} in steps {first}..{last} (latest good "
            f"checkpoint: {self.checkpoints.latest or 'none'})")

  def evaluate(self):
    """Evaluates on the whole eval set and writes `eval/` summaries, with
    `elapsed_seconds` (wall time since `start_time`) once `run()` set it.

    A Controller that has not restored yet (a fresh one) restores the
    latest checkpoint first; with none, it is a CheckpointError (the
    initial weights would be written as a step-0 point of the run).
    """
    if self.eval_input is None:
      return None
    if not self._restored:
      self.restore()
      if self.restored_from is None:
        raise CheckpointError(
            f"model_dir={self.model_dir!r} has no checkpoint to evaluate: "
            "train first (run()), or evaluate the trainer directly "
            "(trainer.evaluate)")
    self.trainer.sync_replica_state()
    data = self.eval_input()
    if isinstance(data, tf.data.Dataset):
      data = self._distribute(self._pad_eval(data))
    results = self.trainer.evaluate(data)
    step = self.step
    scalars = {k: v for k, v in results.items() if k != "examples"}
    if self.start_time is not None:
      # The wall-clock position of each evaluation on the run's time axis
      # (the origin of time_to_target): accuracy against seconds.
      scalars["elapsed_seconds"] = time.time() - self.start_time
    self.writer("eval").scalars(step, scalars)
    logging.info("eval  step %d: %s", step, ", ".join(
        f"{k}={v:.4f}" if k != "examples" else f"{k}={int(v)}"
        for k, v in sorted(results.items())))
    self.last_eval = results
    self._check_target(results, step)
    return results

  def _check_target(self, results, step):
    """Records the time to `stop_at_accuracy` at the first eval reaching it."""
    target = self.config.stop_at_accuracy
    if (target is None or self.time_to_target is not None
        or not self._measure_target):
      return
    accuracy = results.get("accuracy", results.get("pixel_accuracy"))
    if accuracy is None:
      raise ConfigError(f"stop_at_accuracy={target}: the evaluation reports "
                        f"no accuracy (only {', '.join(sorted(results))})")
    if accuracy < target:
      return
    self.time_to_target = time.time() - (self.start_time or time.time())
    self.writer("eval").scalars(
        step, {"time_to_target_seconds": self.time_to_target})
    logging.info("target accuracy %.4f reached at step %d: accuracy=%.4f "
                 "time_to_target_seconds=%.1f", target, step, accuracy,
                 self.time_to_target)

  def _report_profile(self, table, step):
    if table is None:
      return
    first, last = self.config.profile_steps
    logging.info("profile of steps %d..%d (trace: %s):\n%s", first, last,
                 table.trace_path, table.markdown(top=10))
    self.writer("train").text(step, "profile/op_time", table.markdown())

  def restore(self):
    """Restores the latest checkpoint, once (CheckpointError on mismatch)."""
    if not self._restored:
      self.restored_from = self.checkpoints.restore_latest()
      self._restored = True

  def run(self):
    """Trains to `train_steps`, resuming from the latest checkpoint."""
    c = self.config
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
    if record is not None and self._chief:
      run_state.forget_target(self.model_dir)  # it trains on from here
    if step >= c.train_steps:
      logging.info("Already at step %d of %d; nothing to train", step,
                   c.train_steps)
      self._measure_target = False  # it was measured (or not) when trained
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
      self._report_profile(self.profiler.maybe_stop(self.step, force=True),
                           self.step)
    if not self.loss_finite:
      raise NonFiniteLossError(
          f"{self._non_finite_text()}; the run ended without saving a final "
          "checkpoint or weights: lower learning_rate, set clip_norm, or "
          "train on from the last good checkpoint")
    if last_saved != step:
      self.save(step)
    self._record_target(step)
    for fn in self.on_train_end:
      fn(step)
    if self.time_to_target is not None and self.last_eval is not None:
      return self.last_eval  # stopped at the target: just evaluated
    results = self.evaluate()
    self._record_target(step)
    if c.stop_at_accuracy is not None and self.time_to_target is None:
      logging.info("target accuracy %.4f not reached in %d steps",
                   c.stop_at_accuracy, step)
    return results

  def _record_target(self, step):
    """The chief records a reached target beside the checkpoint at `step`."""
    results = self.last_eval
    if self.time_to_target is None or not self._chief or results is None:
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
    batch_size = getattr(self.trainer, "global_batch_size", None)
    if batch_size:
      data = _check_batch_size(data, batch_size)
    return self._distribute(data)

  def _pad_eval(self, data):
    """A plain eval dataset re-batched to the trainer's global batch, the
    last batch padded (`MaskedBatch`), for trainers that take masks."""
    batch_size = getattr(self.trainer, "global_batch_size", None)
    if (not batch_size or not hasattr(self.trainer, "run_eval_step")
        or isinstance(data.element_spec, MaskedBatch)):
      return data
    return pad_batches(data.rebatch(batch_size), batch_size)

  def _distribute(self, data):
    """The trainer's `distribute_dataset` if it has one (a parameter-server
    coordinator evaluates plain datasets itself), else the strategy's."""
    distribute = getattr(self.trainer, "distribute_dataset", None)
    if distribute is None:
      distribute = self.trainer.strategy.experimental_distribute_dataset
    return distribute(data)

  def _train(self, iterator, num_steps):
    """`trainer.train` as floats; a partial batch becomes a DataError."""
    try:
      return {k: float(v) for k, v in
              self.trainer.train(iterator, num_steps).items()}
    except tf.errors.InvalidArgumentError as e:
      # A damaged shard or record (framework/data/integrity.py) first.
      error = integrity.data_error(e) or _partial_batch_error(
          e, getattr(self.trainer, "global_batch_size", None))
      if error is None:
        raise
      raise error from None

  def _train_loops(self, iterator, step):
    """Loops from `step` to `train_steps`; (last step, last saved step)."""
    c, trainer = self.config, self.trainer
    last_saved = start_step = step
    start_time = time.time()
    while step < c.train_steps:
      num_steps = self._steps_to_next_event(step)
      self.profiler.maybe_start(step)
      loop_start = time.time()
      metrics = self._train(iterator, num_steps)
      elapsed = time.time() - loop_start
      # Fewer steps than asked when the loop was told to stop.
      step, num_steps = self.step, self.step - step
      self._report_profile(self.profiler.maybe_stop(step), step)
      self.loss_finite = math.isfinite(metrics["loss"])
      self._last_loop = (step - num_steps + 1, step, metrics["loss"])
      self._check_skipped_steps(step)
      if not math.isfinite(metrics["loss"]) and trainer.nan_policy == "stop":
        raise NonFiniteLossError(
            f"loss is {metrics['loss']} in steps {step - num_steps + 1}.."
            f"{step}; stopped without saving (latest good checkpoint: "
            f"{self.checkpoints.latest or 'none'}); lower learning_rate, set "
            "clip_norm, or use nan_policy=skip")
      step_metrics = dict(metrics)
      metrics["learning_rate"] = learning_rate(trainer.optimizer)
      metrics["steps_per_second"] = num_steps / elapsed
      if getattr(trainer, "global_batch_size", None):
        metrics["examples_per_second"] = (
            num_steps * trainer.global_batch_size / elapsed)
      if getattr(trainer, "skipped_steps", None) is not None and (
          trainer.nan_policy == "skip" or trainer.loss_scale is not None):
        metrics["skipped_steps"] = float(trainer.skipped_steps.numpy())
      if self._due(c.summary_every, step) or step == c.train_steps:
        self.writer("train").scalars(step, metrics)
      if self._due(c.log_every, step) or step == c.train_steps:
        rate = (step - start_step) / max(time.time() - start_time, 1e-9)
        eta = (c.train_steps - step) / max(rate, 1e-9)
        logging.info(
            "train step %d/%d: %s examples/s=%.1f ETA %s%s", step,
            c.train_steps, " ".join(f"{k}={v:.4f}" for k, v in
                                    sorted(step_metrics.items(),
                                           key=lambda kv: kv[0] != "loss")),
            metrics.get("examples_per_second", float("nan")),
            _format_seconds(eta),
            f" skipped_steps={int(metrics['skipped_steps'])}"
            if "skipped_steps" in metrics else "")
      if self._due(c.checkpoint_every, step):
        self.save(step)  # skipped with a warning after a non-finite loss
        last_saved = step if self.loss_finite else last_saved
      if (self._due(c.eval_every, step) and step != c.train_steps
          and step >= c.eval_start_step):
        self.evaluate()
      for fn in self.on_loop_end:
        fn(step)
      if self.time_to_target is not None:
        break
    return step, last_saved

  def _check_skipped_steps(self, step):
    """NonFiniteLossError after `max_skipped_steps` skipped steps in a row
    (nan_policy=skip), before anything of the diverged state is saved."""
    trainer = self.trainer
    if trainer.nan_policy != "skip":
      return
    in_a_row = int(trainer.consecutive_skips.numpy())
    if in_a_row >= trainer.max_skipped_steps:
      raise NonFiniteLossError(
          f"{in_a_row} steps in a row were skipped (steps "
          f"{step - in_a_row + 1}..{step}: non-finite loss or gradient; "
          f"max_skipped_steps={trainer.max_skipped_steps}); stopped without "
          f"saving (latest good checkpoint: "
          f"{self.checkpoints.latest or 'none'}); lower learning_rate or "
          "set clip_norm")
