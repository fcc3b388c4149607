"""Averaging per-replica non-trainable state before it is read or saved.

Keras 3 creates non-trainable variables (BatchNorm moving statistics) with
aggregation NONE, so each replica updates its own copy from its own part of
the batch. Moving averages are linear in the batch statistics, so averaging
the copies before they are read (evaluation, checkpoints) equals averaging
every update.
"""

from typing import Callable

import keras
import tensorflow as tf

from framework import _tf_internal


def replica_sync_fn(model: keras.Model,
                    strategy: tf.distribute.Strategy) -> Callable[[], None]:
  """A function that sets every replica's copy of `model`'s float
  non-trainable variables to their mean (a no-op where there is nothing to
  average: one replica, no such variables, a parameter-server strategy)."""
  variables = [
      getattr(v, "value", v) for v in model.non_trainable_variables
      if "float" in str(v.dtype) and not _tf_internal.is_seed_generator_state(v)]
  variables = [v for v in variables
               if isinstance(v, tf.distribute.DistributedValues)]
  if strategy.num_replicas_in_sync == 1 or not variables or isinstance(
      strategy, tf.distribute.experimental.ParameterServerStrategy):
    return lambda: None

  def replica_fn():
    context = tf.distribute.get_replica_context()
    means = context.all_reduce(tf.distribute.ReduceOp.MEAN,
                               [v.read_value() for v in variables])
    for var, mean in zip(variables, means):
      var.assign(mean)

  return tf.function(lambda: strategy.run(replica_fn))
