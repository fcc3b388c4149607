"""`jit_compile`: the replica step compiled with XLA where TensorFlow can.

    one replica (default, one_device)     the whole replica step: forward,
                                          backward, clip and the update
    several replicas (mirrored,           each replica's forward and backward
    multi_worker_mirrored,                pass (`compute_gradients`); the
    central_storage)                      all-reduce and the one update stay
                                          outside XLA
    tpu                                   compiled by the TPU strategy already
    parameter_server, model parallel      not compiled (one warning line)

Why not the whole step under several replicas: the update is one
`merge_call` (the trainer applies the all-reduced gradient once), and
TensorFlow does not allow that synchronisation point inside a nested
`tf.function`, which an XLA function inside `strategy.run` is. The gradient
computation is where nearly all the arithmetic is, so it is what XLA fuses.

An op that XLA cannot compile (no XLA kernel on this device) fails the first
call; `compile_error` turns TensorFlow's message into one line naming it.
"""

import re

from absl import logging
import tensorflow as tf

STEP = "step"            # the whole replica step
GRADIENTS = "gradients"  # forward and backward of each replica


def _strategy_name(strategy):
  return type(strategy).__name__


def jit_mode(jit_compile, strategy):
  """STEP, GRADIENTS or None: what of the step XLA compiles under
  `strategy`; logs one line saying so (a warning where it cannot)."""
  if not jit_compile:
    return None
  name = _strategy_name(strategy)
  if isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy):
    logging.warning(
        "jit_compile: not supported under %s (its workers read variables on "
        "the parameter servers, outside any one XLA device); training "
        "without XLA", name)
    return None
  if isinstance(strategy, tf.distribute.TPUStrategy):
    logging.info("jit_compile: %s compiles the whole step with XLA already",
                 name)
    return None
  # Mirrored kinds run each replica in a thread of its own and synchronise
  # them in merge_call, even with one device.
  mirrored = (tf.distribute.MirroredStrategy,
              tf.distribute.MultiWorkerMirroredStrategy,
              tf.distribute.experimental.CentralStorageStrategy)
  if strategy.num_replicas_in_sync == 1 and not isinstance(strategy,
                                                           mirrored):
    logging.info("jit_compile: the whole replica step (forward, backward, "
                 "update) is compiled with XLA under %s", name)
    return STEP
  logging.info(
      "jit_compile: each replica's forward and backward pass is compiled "
      "with XLA under %s (%d replicas); the all-reduce and the update stay "
      "outside it (TensorFlow allows no merge_call inside a nested XLA "
      "function)", name, strategy.num_replicas_in_sync)
  return GRADIENTS


def compiled(fn):
  """`fn` as a `tf.function(jit_compile=True)`."""
  return tf.function(fn, jit_compile=True)


def compiled_step(trainer):
  """`trainer.train_step` compiled, for `strategy.run`.

  The step loop calls it once per step of its body, but Python traces it
  once: what the trace saw (`apply_gradients` called) is replayed on every
  call, so that the loop's feature check sees it each time.
  """
  traced = {}

  def step(batch):
    outputs = trainer.train_step(batch)
    traced["applied"] = trainer._applied_in_trace  # pylint: disable=protected-access
    return outputs

  jitted = compiled(step)

  def replica_step(batch):
    outputs = jitted(batch)
    if traced.get("applied"):
      trainer._applied_in_trace = True  # pylint: disable=protected-access
    return outputs

  return replica_step


_UNSUPPORTED = re.compile(
    r"(?:Detected unsupported operations when trying to compile graph"
    r"|No registered '(\w+)' OpKernel for XLA_\w+"
    r"|XLA compilation requires)", re.S)


def compile_error(error):
  """One line for an XLA compilation failure (None if `error` is another
  error): the ops XLA lacks, and what to do."""
  text = str(error)
  if not _UNSUPPORTED.search(text):
    return None
  ops = sorted(set(re.findall(r"No registered '(\w+)' OpKernel", text)) |
               set(re.findall(r"\b(\w+) \(No registered", text)))
  what = (f"the step's op{'s' if len(ops) > 1 else ''} {', '.join(ops)} "
          "ha" + ("ve" if len(ops) > 1 else "s") + " no XLA kernel here"
          if ops else "XLA cannot compile the step (" +
          text.strip().splitlines()[0][:200] + ")")
  return f"jit_compile: {what}; run without jit_compile"
