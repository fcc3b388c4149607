"""An exponential moving average (EMA) of the weights, distribution-correct.

    average = decay * average + (1 - decay) * weight      after every update

The Trainer updates the average in the cross-replica context of its one
optimizer update (`Trainer._update`, after the weights changed), with
`strategy.extended.update`: each replica's copy of an average is updated on
its own device from that device's copy of the weight. The weights' copies are
equal (they all applied the same all-reduced gradient), so the averages'
copies are equal too, and the average is taken once per step, never per
replica. A step skipped for a non-finite gradient (nan_policy=skip, float16
overflow) changes neither the weights nor the average.

Only trainable variables are averaged: BatchNorm's moving statistics are
already moving averages and are used as they are. The averages and their
update count are checkpointed (`checkpoint_items`), so a resumed run
continues the same average. Evaluation and the exported weights use the
average (`swapped`); the checkpoints keep the raw weights that training
continues from.

With `warmup`, the decay of update n (from 0) is min(decay, (1 + n) /
(10 + n)), as in `tf.train.ExponentialMovingAverage(num_updates=...)`: early
averages forget the random initialisation quickly, which matters for runs of
a few hundred steps.
"""

import contextlib

import tensorflow as tf

from framework.errors import ConfigError


def _tf_variable(variable):
  return getattr(variable, "value", variable)  # the tf.Variable of a Keras one


def _assign(target, source):
  return target.assign(tf.cast(source, target.dtype))


class WeightAverage:
  """EMAs of `variables`, created under `strategy` like the variables.

  Args:
    variables: the (Keras or tf) variables to average, e.g. a model's
      trainable variables; created under `strategy.scope()`.
    strategy: their strategy.
    decay: in (0, 1); the weight of the old average at each update.
    warmup: use min(decay, (1 + n) / (10 + n)) at update n.
  """

  def __init__(self, variables, strategy, decay, *, warmup=False):
    if not 0 < decay < 1:
      raise ConfigError(f"ema_decay={decay} must be in (0, 1)")
    if isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy):
      # Workers update concurrently: a read-modify-write average would race.
      raise ConfigError("ema_decay is not supported under "
                        "strategy=parameter_server")
    self.decay = float(decay)
    self.warmup = bool(warmup)
    self.strategy = strategy
    self.variables = [_tf_variable(v) for v in variables]
    with strategy.scope():
      self.averages = [self._copy(v, "ema") for v in self.variables]
      # Holds the raw weights while `swapped` puts the averages in place.
      self._backups = [self._copy(v, "ema_backup") for v in self.variables]
      self.num_updates = tf.Variable(
          0, dtype=tf.int64, trainable=False, name="ema_num_updates",
          aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)

  @staticmethod
  def _copy(variable, prefix):
    name = variable.name.split(":")[0].replace("/", "_")
    return tf.Variable(
        tf.identity(variable), trainable=False, name=f"{prefix}_{name}",
        aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)

  def current_decay(self):
    """The decay the next update uses (a float32 tensor)."""
    decay = tf.constant(self.decay, tf.float32)
    if not self.warmup:
      return decay
    n = tf.cast(self.num_updates, tf.float32)
    return tf.minimum(decay, (1.0 + n) / (10.0 + n))

  def update(self):
    """One EMA step from the current weights (cross-replica context)."""
    strategy = self.strategy
    decay = self.current_decay()

    def one(average, weight):
      weight = tf.cast(weight, average.dtype)
      d = tf.cast(decay, average.dtype)
      return average.assign(d * average + (1 - d) * weight)

    updates = [strategy.extended.update(a, one, args=(v,), group=False)
               for a, v in zip(self.averages, self.variables)]
    with tf.control_dependencies(tf.nest.flatten(updates)):
      return strategy.extended.update(
          self.num_updates, lambda n: n.assign_add(1), group=False)

  def _copy_all(self, targets, sources):
    for target, source in zip(targets, sources):
      self.strategy.extended.update(target, _assign, args=(source,))

  @contextlib.contextmanager
  def swapped(self):
    """Within the block the variables hold their averages (eager, cross-
    replica context: evaluation, saving weights); the raw weights return
    afterwards, bit for bit."""
    self._copy_all(self._backups, self.variables)
    self._copy_all(self.variables, self.averages)
    try:
      yield
    finally:
      self._copy_all(self.variables, self._backups)

  def checkpoint_items(self):
    """Trackables to checkpoint so that a resumed run continues the EMA."""
    return {"ema": {"averages": list(self.averages),
                    "num_updates": self.num_updates}}
