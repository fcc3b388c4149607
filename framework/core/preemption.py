"""SIGTERM (preemption) or Ctrl-C -> every worker saves a checkpoint -> exit 42.

Cluster schedulers announce preemption with SIGTERM and kill the process a
grace period later (Kubernetes: 30 s). On SIGTERM or a first SIGINT (Ctrl-C),
distloop saves a checkpoint and exits with `EXIT_PREEMPTED`; relaunching
resumes from it. A second Ctrl-C exits at once with status 130, saving
nothing.

- Single-process strategies: the main thread is inside the graph call of a
  training loop when the signal comes, where no Python signal handler can
  run. A watcher thread, woken through `signal.set_wakeup_fd`, sets the
  trainer's stop flag, which the in-graph loop reads before every step: the
  loop ends after the current step, and the train action saves and exits.
- MultiWorkerMirroredStrategy: the save is a collective, so all workers must
  save at the same step although only one got the signal (TensorFlow's
  collective runtime keeps the other workers unaware). TensorFlow's
  `PreemptionCheckpointHandler` agrees on that step through the coordination
  service, at a loop end (a loop is not cut short: its collectives need every
  worker); distloop's checkpoint manager does the save. Ctrl-C is turned
  into a SIGTERM for that handler.
- Parameter server: the coordinator's train action saves and exits.
"""

import os
import signal
import sys
import threading
from typing import Any, Callable

from absl import logging
import tensorflow as tf

from framework import _tf_internal
from framework.distribute import strategies
from framework.core import protocols
from framework.core import run_lock

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
    run_lock.release_all()
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
      if isinstance(self.controller.trainer, protocols.Stoppable):
        self.controller.trainer.request_stop()

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
    run_lock.release_all()
    os._exit(EXIT_PREEMPTED)  # pylint: disable=protected-access

  def __call__(self, step, outputs=None):
    if self.received:
      # Controller.save skips the save after a non-finite loss.
      _exit(step, saved=self.controller.save(step) is not None, at_once=True)


class _MultiWorkerPreemption:
  """PreemptionCheckpointHandler, saving through the controller's manager."""

  def __init__(self, controller):
    self.controller = controller
    self._step = None
    strategy = controller.trainer.strategy
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
    run_lock.release_all()
    os._exit(EXIT_TERMINATED)  # pylint: disable=protected-access

  _watch_signals(on_signal, (signal.SIGTERM,))


def install(controller: Any) -> Callable[[int, Any], None]:
  """Makes `controller` save and exit with EXIT_PREEMPTED on SIGTERM or a
  first SIGINT (a second SIGINT exits at once with EXIT_INTERRUPTED).

  Call after creating the controller and before `controller.run()`.
  Returns the train action `fn(step, outputs)` (also appended to
  `controller.train_actions`).
  """
  strategy = controller.trainer.strategy
  if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) and (
      strategies.task_info(strategy)[0] is not None):
    hook = _MultiWorkerPreemption(controller)
  else:
    hook = _LocalPreemption(controller)
  controller.train_actions.append(hook)
  return hook


# The public name (`framework.install_preemption_handler`).
install_preemption_handler = install
