"""SIGTERM (preemption) -> every worker saves a checkpoint -> exit 42.

Cluster schedulers announce preemption with SIGTERM and kill the process a
grace period later. On SIGTERM, distloop finishes the current loop, saves a
checkpoint and exits with `EXIT_PREEMPTED`; relaunching resumes from it.

- Single-process strategies: a SIGTERM handler sets a flag that the loop
  checks after each `steps_per_loop` chunk.
- MultiWorkerMirroredStrategy: the save is a collective, so all workers must
  save at the same step although only one got the signal (TensorFlow's
  collective runtime keeps the other workers unaware). TensorFlow's
  `PreemptionCheckpointHandler` agrees on that step through the coordination
  service; distloop's checkpoint manager does the save.
"""

import signal
import sys

from absl import logging
import tensorflow as tf

from framework import strategies

# Exit status after a preemption checkpoint: "relaunch me to resume".
EXIT_PREEMPTED = 42


def _exit(step):
  logging.info("Preempted: checkpoint saved at step %d; exiting with status "
               "%d (relaunch to resume)", step, EXIT_PREEMPTED)
  logging.flush()
  sys.exit(EXIT_PREEMPTED)


class _LocalPreemption:
  """SIGTERM -> flag; the next loop end saves and exits."""

  def __init__(self, controller):
    self.controller = controller
    self.received = False
    signal.signal(signal.SIGTERM, self._on_sigterm)

  def _on_sigterm(self, signum, frame):
    del signum, frame
    self.received = True

  def __call__(self, step):
    if self.received:
      self.controller.save(step)
      _exit(step)


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

  def _save(self, step):
    self.controller.checkpoints.save(step)

  def __call__(self, step):
    self._step = step
    self.handler.save_checkpoint_if_preempted(step)


def install(controller):
  """Makes `controller` save and exit with EXIT_PREEMPTED on SIGTERM.

  Call after creating the controller and before `controller.run()`.
  Returns the loop-end hook (also appended to `controller.on_loop_end`).
  """
  strategy = controller.trainer.strategy
  if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) and (
      strategies.task_info(strategy)[0] is not None):
    hook = _MultiWorkerPreemption(controller)
  else:
    hook = _LocalPreemption(controller)
  controller.on_loop_end.append(hook)
  return hook
