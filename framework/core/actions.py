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
preemption (`framework.core.actions.install`) and the segmentation mask
summaries; `LossAtChance`, a one-line warning when the training loss
stays at chance.
"""

import dataclasses
import math
import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Mapping, Optional

from absl import logging
import tensorflow as tf

from framework import _tf_internal
from framework.core.checkpoints import run_files
from framework.core.config import StopCondition
from framework.distribute import strategies
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
      (`LoopParts.metric_aliases`).
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
    parts = c.parts
    policy = parts.nan_policy
    if policy == "skip" and parts.consecutive_skips is not None:
      in_a_row = parts.consecutive_skips()
      if in_a_row >= parts.max_skipped_steps:
        raise NonFiniteLossError(
            f"{in_a_row} steps in a row were skipped (steps "
            f"{step - in_a_row + 1}..{step}: non-finite loss or gradient; "
            f"max_skipped_steps={parts.max_skipped_steps}); stopped "
            f"without saving (latest good checkpoint: "
            f"{c.checkpoints.latest or 'none'}); lower learning_rate or set "
            "clip_norm")
    if not c.loss_finite and policy == "stop":
      raise NonFiniteLossError(
          f"{c.non_finite_text(name_checkpoint=False)}; stopped without saving "
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


# Time to target: when a run first meets its stop condition, and the
# record that lets a relaunch of a finished run train nothing.
#
# `LoopConfig.stop_when` / `stop_at_accuracy` become a `StopWhen` action
# (after every loop for a train/ condition, after every evaluation else).
# It returns `TargetReached`; the tracker applies it once: `time_to_target`
# is the wall time from the Controller's `start_time` to the end of that
# evaluation (or loop): everything in between counts (building the input
# pipeline, tracing, every step, every evaluation, checkpoints and
# summaries). `start_time` defaults to the start of `Controller.run()`;
# `experiment.run` sets it to its own start, so loading the dataset and
# building the model count too. A resumed run counts from its own start.
#
# The target's metric is `accuracy` under the name the evaluator reports it
# (`LoopParts.metric_aliases`, e.g. a task's own name for it). With
# `stop_at_accuracy` the chief writes `target_reached.json` beside the final
# checkpoint (`framework.core.checkpoints.run_files`): relaunched with the same settings
# the run trains nothing; with more steps it continues past the target
# without stopping at it again (a higher target is a new one).
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
                  ) -> Optional[StopWhen]:
    """The `StopWhen` action for the condition (None without one);
    `results` gives an eval split's latest results."""
    if self.condition is None:
      return None
    c = self.config
    return StopWhen(
        self.condition, description=(
            f"{TARGET_METRIC} {c.stop_at_accuracy:.4f}"
            if c.stop_when is None else None),
        results=results, aliases=self.aliases)

  def finished(self, step: int) -> Optional[dict]:
    """The record of an earlier launch that stopped at this target at
    `step` (then nothing is left to train: logged), else None."""
    c = self.config
    record = run_files.read_target(self.model_dir)
    if not run_files.finished_at_target(record, step, c.train_steps,
                                        c.stop_at_accuracy):
      return None
    logging.info(
        "Already finished: %s %.4f reached stop_at_accuracy=%.4f at step %d "
        "(%s); nothing to train (raise train_steps or the target to "
        "continue)", TARGET_METRIC, record["accuracy"], c.stop_at_accuracy,
        step, run_files.TARGET_FILE)
    return record

  def resume(self, step: int) -> None:
    """A run restored at `step` trains on: past a target it met (kept, not
    measured again), or from a record it no longer meets (removed)."""
    c = self.config
    record = run_files.read_target(self.model_dir)
    if run_files.continues_past_target(record, step, c.stop_at_accuracy):
      self.measuring = False
      logging.info(
          "%s %.4f reached stop_at_accuracy=%.4f at step %d "
          "(time_to_target_seconds=%.1f, kept in %s); training on to step "
          "%d without stopping at that target again (a higher "
          "stop_at_accuracy is a new target)", TARGET_METRIC,
          record["accuracy"], c.stop_at_accuracy, int(record["step"]),
          float(record.get("time_to_target_seconds", float("nan"))),
          run_files.TARGET_FILE, c.train_steps)
    elif record is not None and self.chief:
      run_files.forget_target(self.model_dir)

  def reached(self, step: int, decision: TargetReached,
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
    run_files.record_target(
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


# SIGTERM (preemption) or Ctrl-C -> every worker saves a checkpoint -> exit 42.
#
# Cluster schedulers announce preemption with SIGTERM and kill the process a
# grace period later (Kubernetes: 30 s). On SIGTERM or a first SIGINT (Ctrl-C),
# distloop saves a checkpoint and exits with `EXIT_PREEMPTED`; relaunching
# resumes from it. A second Ctrl-C exits at once with status 130, saving
# nothing.
#
# - Single-process strategies: the main thread is inside the graph call of a
#   training loop when the signal comes, where no Python signal handler can
#   run. A watcher thread, woken through `signal.set_wakeup_fd`, sets the
#   trainer's stop flag, which the in-graph loop reads before every step: the
#   loop ends after the current step, and the train action saves and exits.
# - MultiWorkerMirroredStrategy: the save is a collective, so all workers must
#   save at the same step although only one got the signal (TensorFlow's
#   collective runtime keeps the other workers unaware). TensorFlow's
#   `PreemptionCheckpointHandler` agrees on that step through the coordination
#   service, at a loop end (a loop is not cut short: its collectives need every
#   worker); distloop's checkpoint manager does the save. Ctrl-C is turned
#   into a SIGTERM for that handler.
# - Parameter server: the coordinator's train action saves and exits.
# Exit status after a preemption checkpoint: "relaunch me to resume".
EXIT_PREEMPTED = 42


# Exit status after a second Ctrl-C (128 + SIGINT, as a shell reports it).
EXIT_INTERRUPTED = 130

# Exit status after a SIGTERM before training started (128 + SIGTERM).
EXIT_TERMINATED = 143


def _exit(step, saved=True, at_once=False):
  if saved:
    logging.info("Preempted: checkpoint saved at step %d; exiting with status "
                 "%d (relaunch to resume)", step, EXIT_PREEMPTED)
  else:
    logging.warning("Preempted at step %d without saving (the loss was not "
                    "finite); exiting with status %d (relaunch to resume from "
                    "the latest good checkpoint)", step, EXIT_PREEMPTED)
  logging.flush()
  if at_once:
    # Everything is on disk (summaries are flushed on write). Tearing down
    # TensorFlow's runtime took another ~10 s, a third of Kubernetes's
    # 30 s grace period.
    sys.stdout.flush()
    sys.stderr.flush()
    run_files.release_all()
    os._exit(EXIT_PREEMPTED)  # pylint: disable=protected-access
  sys.exit(EXIT_PREEMPTED)


def _watch_signals(on_signal, handled):
  """Calls `on_signal(signum)` from a thread for each signal that has a
  Python handler; installs no-op handlers for `handled`.

  Python runs signal handlers in the main thread only, between bytecodes:
  not while it waits in a graph call. The C-level handler still writes the
  signal number to the wakeup fd at once, which this thread reads.
  """
  read_fd, write_fd = os.pipe()
  os.set_blocking(write_fd, False)
  for signum in handled:
    signal.signal(signum, lambda signum, frame: None)
  signal.set_wakeup_fd(write_fd)

  def watch():
    while True:
      for signum in os.read(read_fd, 64):
        on_signal(signum)

  threading.Thread(target=watch, name="distloop-signal-watcher",
                   daemon=True).start()


class _Interrupts:
  """Counts Ctrl-Cs: the first is handled, the second exits at once."""

  def __init__(self):
    self.count = 0

  def arrived(self):
    self.count += 1
    if self.count > 1:
      print("Interrupted again: exiting at once without saving",
            file=sys.stderr, flush=True)
      os._exit(EXIT_INTERRUPTED)  # pylint: disable=protected-access


class _LocalPreemption:
  """SIGTERM or SIGINT -> stop the in-graph loop after its current step;
  the train action then saves and exits. Once training is over (its final
  checkpoint saved: the final evaluation and export run), the process
  exits at once with EXIT_PREEMPTED; relaunching does those again."""

  def __init__(self, controller):
    self.controller = controller
    self.received = None
    self.finished_step = None
    self._lock = threading.Lock()
    self._interrupts = _Interrupts()
    controller.on_train_end.append(self.train_ended)
    _watch_signals(self._on_signal, (signal.SIGTERM, signal.SIGINT))

  def _on_signal(self, signum):  # in the watcher thread
    if signum == signal.SIGINT:
      self._interrupts.arrived()
    elif signum != signal.SIGTERM:
      return
    with self._lock:
      if self.received is not None:
        return
      self.received = signal.Signals(signum).name
      if self.finished_step is not None:
        self._exit_after_training()
      logging.info("%s received: saving a checkpoint after the current step "
                   "(Ctrl-C again to quit without saving)", self.received)
      if self.controller.parts.request_stop is not None:
        self.controller.parts.request_stop()

  def train_ended(self, step):
    """Training is over and its checkpoint at `step` saved (or restored)."""
    with self._lock:
      self.finished_step = step
      if self.received is None:
        return
      # A controller that stopped early stopped on the signal's request,
      # which came after this loop's train actions (this hook among them):
      # a preemption at the checkpoint just saved, not the end of the run.
      if getattr(self.controller, "stop_reason", None) is not None:
        _exit(step, at_once=True)  # does not return
      else:
        self._exit_after_training()

  def _exit_after_training(self):
    logging.info(
        "%s received after training ended: the final checkpoint (step %d) "
        "is saved; exiting now with status %d, without the final "
        "evaluation and export (relaunch to do them)", self.received,
        self.finished_step, EXIT_PREEMPTED)
    logging.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    run_files.release_all()
    os._exit(EXIT_PREEMPTED)  # pylint: disable=protected-access

  def __call__(self, step, outputs=None):
    if self.received:
      # Controller.save skips the save after a non-finite loss.
      saved = self.controller.save(step) is not None
      self.controller.wait_for_checkpoint()  # os._exit skips TF's own wait
      _exit(step, saved=saved, at_once=True)


_previous_excepthook = None  # threading's hook before _quiet_lost_peers


def _quiet_lost_peers():
  """Makes a lost peer in a PreemptionCheckpointHandler's thread one
  warning line instead of a traceback (idempotent).

  When the chief (which leads the coordination service) dies, the
  handler's peer watcher raises "Socket closed" in its own thread; the
  main thread then reports the lost task in one line.
  """
  global _previous_excepthook
  if _previous_excepthook is not None:
    return
  _previous_excepthook = threading.excepthook

  def hook(args):
    if (_tf_internal.is_preemption_thread(args.thread)
        and issubclass(args.exc_type, tf.errors.OpError)):
      logging.warning("%s ended: %s", args.thread.name,
                      str(args.exc_value).splitlines()[0][:200]
                      if str(args.exc_value) else args.exc_type.__name__)
      return
    _previous_excepthook(args)

  threading.excepthook = hook


def _tolerate_a_lost_coordinator():
  """Wraps the SIGTERM handler a PreemptionCheckpointHandler installed: a
  coordination service that is gone is one warning line, not a traceback.

  The handler tells the peers of a SIGTERM through the chief's
  coordination service. When the chief died, the launcher's SIGTERM to
  the others raised "Connection refused" from the handler in the main
  thread, which hid that task's own one-line error about the lost peer.
  """
  handler = signal.getsignal(signal.SIGTERM)
  if not callable(handler):
    return

  def on_sigterm(signum, frame):
    try:
      handler(signum, frame)
    except tf.errors.OpError as e:
      logging.warning("SIGTERM not shared with the cluster, whose "
                      "coordination service is gone: %s",
                      str(e).splitlines()[0][:200] if str(e)
                      else type(e).__name__)

  signal.signal(signal.SIGTERM, on_sigterm)


class _MultiWorkerPreemption:
  """PreemptionCheckpointHandler, saving through the controller's manager."""

  def __init__(self, controller):
    self.controller = controller
    _quiet_lost_peers()
    self._step = None
    strategy = controller.parts.strategy
    # The handler restores its run counter from the chief's directory on
    # every worker, so that all workers count loops alike.
    reader = tf.train.CheckpointManager(
        controller.checkpoint, controller.model_dir,
        max_to_keep=controller.config.keep_checkpoints,
        checkpoint_name="ckpt")
    config = tf.distribute.experimental.TerminationConfig(
        exit_fn=lambda: _exit(self._step), save_fn=self._save, grace_period=0)
    self.handler = tf.distribute.experimental.PreemptionCheckpointHandler(
        strategy.cluster_resolver, reader, termination_config=config)
    _tolerate_a_lost_coordinator()
    # After the handler installed its SIGTERM handler: a first Ctrl-C
    # becomes a SIGTERM for it (all workers agree on a step and save).
    self._interrupts = _Interrupts()
    _watch_signals(self._on_signal, (signal.SIGINT,))
    controller.on_train_end.append(self._stop_watching_peers)

  def _stop_watching_peers(self, step):
    """Ends the handler's peer-watcher thread while every task is still up.

    Left to the handler's `__del__`, it was still blocked on the
    coordination service when the chief exited, and printed
    "Exception in thread PeerTerminationWatcher ... Socket closed"."""
    del step
    _tf_internal.stop_peer_watcher(self.handler)

  def _on_signal(self, signum):  # in the watcher thread
    if signum == signal.SIGINT:
      self._interrupts.arrived()
      os.kill(os.getpid(), signal.SIGTERM)

  def _save(self, step):
    self.controller.checkpoints.save(step)

  def __call__(self, step, outputs=None):
    self._step = step
    self.handler.save_checkpoint_if_preempted(step)


def guard_start(program):
  """Until `install` takes over: SIGTERM -> one line on stderr, model_dir
  as it was (a folder this run created and left empty is removed), exit
  status EXIT_TERMINATED.

  Call from the main thread before the run loads its data and builds its
  model. Works while the main thread waits inside TensorFlow (the signal
  is read by a thread); `install` later points the wakeup fd elsewhere,
  which ends this guard.
  """

  def on_signal(signum):  # in the watcher thread
    if signum != signal.SIGTERM:
      return
    print(f"{program}: terminated (SIGTERM) before training started; "
          "nothing was saved", file=sys.stderr, flush=True)
    run_files.release_all()
    os._exit(EXIT_TERMINATED)  # pylint: disable=protected-access

  _watch_signals(on_signal, (signal.SIGTERM,))


def install(controller: Any) -> Callable[[int, Any], None]:
  """Makes `controller` save and exit with EXIT_PREEMPTED on SIGTERM or a
  first SIGINT (a second SIGINT exits at once with EXIT_INTERRUPTED).

  Call after creating the controller and before `controller.run()`.
  Returns the train action `fn(step, outputs)` (also appended to
  `controller.train_actions`).
  """
  strategy = controller.parts.strategy
  if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) and (
      strategies.task_info(strategy)[0] is not None):
    hook = _MultiWorkerPreemption(controller)
  else:
    hook = _LocalPreemption(controller)
  controller.train_actions.append(hook)
  return hook


# The public name (`framework.install_preemption_handler`).
install_preemption_handler = install
