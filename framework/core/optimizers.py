"""Optimizers and learning-rate schedules by name.

The optimizers are plain Keras 3 optimizers; distloop never calls their
`apply_gradients` from a replica context (that would all-reduce a second
time), see `Trainer.apply_gradients`.
"""

import contextlib
import math

import keras
import tensorflow as tf

from framework import _tf_internal
from framework.core.config import (DECAYING_SCHEDULES, LR_SCALINGS, OPTIMIZERS, SCHEDULES, OptimizerConfig)
from framework.errors import ConfigError, check_positive


# onecycle without warmup_steps: this fraction of the run rises to the peak.
ONECYCLE_RISE = 0.3


class WarmupSchedule(keras.optimizers.schedules.LearningRateSchedule):
  """Linear warm-up from 0 to `after(warmup_steps)`, then `after(step)`."""

  def __init__(self, after, warmup_steps):
    self.after = after
    self.warmup_steps = warmup_steps

  def __call__(self, step):
    step = tf.cast(step, tf.float32)
    target = tf.cast(self.after(step), tf.float32)
    if not self.warmup_steps:
      return target
    warm = tf.cast(self.after(float(self.warmup_steps)), tf.float32) * (
        (step + 1.0) / self.warmup_steps)
    return tf.where(step < self.warmup_steps, warm, target)

  def get_config(self):
    return {"after": keras.optimizers.schedules.serialize(self.after),
            "warmup_steps": self.warmup_steps}


class _LinearDecay(keras.optimizers.schedules.LearningRateSchedule):
  """`peak` at `start`, linearly to `end_value` at `end`, then constant."""

  def __init__(self, peak, start, end, end_value):
    self.peak = peak
    self.start = start
    self.end = end
    self.end_value = end_value

  def __call__(self, step):
    step = tf.cast(step, tf.float32)
    done = tf.clip_by_value((step - self.start) / max(self.end - self.start, 1),
                            0.0, 1.0)
    return self.peak + (self.end_value - self.peak) * done

  def get_config(self):
    return {"peak": self.peak, "start": self.start, "end": self.end,
            "end_value": self.end_value}


class WsdSchedule(keras.optimizers.schedules.LearningRateSchedule):
  """Warmup-stable-decay's tail: `peak` until `decay_start`, then over
  `decay_steps` (linearly, or along half a cosine) to `end_value`, then
  constant. A pure function of the step, so a resumed run continues it
  exactly."""

  def __init__(self, peak, decay_start, decay_steps, end_value, shape):
    self.peak = peak
    self.decay_start = decay_start
    self.decay_steps = decay_steps
    self.end_value = end_value
    self.shape = shape

  def __call__(self, step):
    step = tf.cast(step, tf.float32)
    done = tf.clip_by_value((step - self.decay_start) / self.decay_steps,
                            0.0, 1.0)
    if self.shape == "cosine":
      done = 0.5 * (1.0 - tf.cos(math.pi * done))
    return self.peak + (self.end_value - self.peak) * done

  def get_config(self):
    return {"peak": self.peak, "decay_start": self.decay_start,
            "decay_steps": self.decay_steps, "end_value": self.end_value,
            "shape": self.shape}


def _wsd(config):
  """`lr_schedule=wsd`: checked against the run's length."""
  total = config.total_steps
  check_positive("total_steps (for lr_schedule=wsd)", total)
  decay = max(int(round(config.decay_fraction * total)), 1)
  if config.warmup_steps + decay > total:
    raise ConfigError(
        f"warmup_steps={config.warmup_steps} + the decay tail "
        f"(decay_fraction={config.decay_fraction} of {total} steps = "
        f"{decay}) must be <= total_steps={total} (the run's train_steps) "
        f"for lr_schedule=wsd; "
        f"lower them or train longer")
  after = WsdSchedule(config.learning_rate, total - decay, decay,
                      config.learning_rate * config.min_lr_ratio,
                      config.decay_shape)
  return WarmupSchedule(after, config.warmup_steps)


class _Constant(keras.optimizers.schedules.LearningRateSchedule):

  def __init__(self, value):
    self.value = value

  def __call__(self, step):
    del step
    return tf.constant(self.value, tf.float32)

  def get_config(self):
    return {"value": self.value}


class _Shifted(keras.optimizers.schedules.LearningRateSchedule):
  """`after(max(step - shift, 0))`: a schedule that starts after the
  warm-up. A class, not a lambda, so the optimizer's `get_config` works (a
  split's copies build their optimizers from it)."""

  def __init__(self, after, shift):
    self.after = after
    self.shift = shift

  def __call__(self, step):
    return self.after(tf.maximum(step - self.shift, 0))

  def get_config(self):
    return {"after": keras.optimizers.schedules.serialize(self.after),
            "shift": self.shift}


def make_schedule(config):
  """The learning-rate schedule (a function of the optimizer step)."""
  peak = config.learning_rate
  if config.schedule in ("linear", "onecycle"):
    check_positive(f"total_steps (for lr_schedule={config.schedule})",
                   config.total_steps)
    warmup = config.warmup_steps
    if config.schedule == "onecycle" and not warmup:
      warmup = max(int(round(ONECYCLE_RISE * config.total_steps)), 1)
    if warmup >= config.total_steps:
      raise ConfigError(f"warmup_steps={warmup} must be < total_steps="
                        f"{config.total_steps} for lr_schedule="
                        f"{config.schedule}")
    after = _LinearDecay(peak, warmup, config.total_steps,
                         peak * config.min_lr_ratio)
    return WarmupSchedule(after, warmup)
  if config.schedule == "wsd":
    return _wsd(config)
  if config.schedule == "cosine":
    check_positive("total_steps (for lr_schedule=cosine)", config.total_steps)
    after = keras.optimizers.schedules.CosineDecay(
        peak, decay_steps=max(config.total_steps - config.warmup_steps, 1),
        alpha=config.min_lr_ratio)
    return WarmupSchedule(_Shifted(after, config.warmup_steps),
                          config.warmup_steps)
  if config.schedule == "step":
    values = [peak * config.step_decay**i
              for i in range(len(config.step_boundaries) + 1)]
    after = keras.optimizers.schedules.PiecewiseConstantDecay(
        list(config.step_boundaries), values)
    return WarmupSchedule(after, config.warmup_steps)
  return WarmupSchedule(_Constant(peak), config.warmup_steps)


def make_optimizer(config):
  """A Keras 3 optimizer for `config` (call inside `strategy.scope()`)."""
  lr = make_schedule(config)
  if config.name == "sgd":
    return keras.optimizers.SGD(lr)
  if config.name == "momentum":
    return keras.optimizers.SGD(lr, momentum=config.momentum,
                                nesterov=config.nesterov)
  if config.name == "adam":
    return keras.optimizers.Adam(lr)
  return keras.optimizers.AdamW(lr, weight_decay=config.weight_decay)


# One fused kernel per variable for the optimizer update.
#
# Keras 3 optimizers are written once for every backend, so `Adam.update_step`
# is about a dozen element-wise ops, each a separate pass over the variable
# or its slots. TensorFlow has had the whole update as one kernel since TF 1
# (`ResourceApplyAdam`, `ResourceApplyKerasMomentum`,
# `ResourceApplyGradientDescent`): the same formula, one pass. Because the
# Trainer owns the update (see `Trainer.apply_gradients`), it can use them:
#
#     update = fused_update(optimizer)   # None: use optimizer.update_step
#     update(grad, var, learning_rate)   # inside strategy.extended.update
#
# The state stays the optimizer's own slot variables, so checkpoints, Keras's
# `update_step` and these kernels are interchangeable at any step.
def _handle(variable):
  """The resource handle of a Keras or tf variable (inside
  `strategy.extended.update`, a distributed variable's local copy)."""
  return getattr(variable, "value", variable).handle


def _adam(optimizer):
  def update(grad, var, learning_rate):
    dtype = var.dtype
    index = _tf_internal.optimizer_variable_index(optimizer, var)
    m, v = _tf_internal.adam_slots(optimizer, index)
    step = tf.cast(optimizer.iterations + 1, dtype)
    beta_1 = tf.cast(optimizer.beta_1, dtype)
    beta_2 = tf.cast(optimizer.beta_2, dtype)
    return tf.raw_ops.ResourceApplyAdam(
        var=var.handle,
        m=_handle(m), v=_handle(v),
        beta1_power=tf.pow(beta_1, step), beta2_power=tf.pow(beta_2, step),
        lr=tf.cast(learning_rate, dtype), beta1=beta_1, beta2=beta_2,
        epsilon=tf.cast(optimizer.epsilon, dtype),
        grad=tf.cast(grad, dtype))
  return update


def _sgd(optimizer):
  def update(grad, var, learning_rate):
    dtype = var.dtype
    grad, learning_rate = tf.cast(grad, dtype), tf.cast(learning_rate, dtype)
    if optimizer.momentum == 0:
      return tf.raw_ops.ResourceApplyGradientDescent(
          var=var.handle, alpha=learning_rate, delta=grad)
    index = _tf_internal.optimizer_variable_index(optimizer, var)
    # accum = momentum * accum - lr * grad; var += accum (Keras's SGD).
    return tf.raw_ops.ResourceApplyKerasMomentum(
        var=var.handle, accum=_handle(optimizer.momentums[index]),
        lr=learning_rate, grad=grad,
        momentum=tf.cast(optimizer.momentum, dtype),
        use_nesterov=bool(optimizer.nesterov))
  return update


def fused_update(optimizer):
  """`(grad, var, learning_rate) -> op` doing `optimizer.update_step` in one
  kernel, or None where there is none (other optimizers, AMSGrad).

  Exact classes only: a subclass may have changed `update_step`. AdamW is
  Adam's update after a decoupled weight decay, which the caller applies.
  """
  kind = type(optimizer)
  if kind in (keras.optimizers.Adam, keras.optimizers.AdamW):
    return None if optimizer.amsgrad else _adam(optimizer)
  if kind is keras.optimizers.SGD:
    return _sgd(optimizer)
  return None


# An exponential moving average (EMA) of the weights, distribution-correct.
#
#     average = decay * average + (1 - decay) * weight      after every update
#
# The Trainer updates the average in the cross-replica context of its one
# optimizer update (`updates.MergeCallUpdate`, after the weights changed), with
# `strategy.extended.update`: each replica's copy of an average is updated on
# its own device from that device's copy of the weight. The weights' copies are
# equal (they all applied the same all-reduced gradient), so the averages'
# copies are equal too, and the average is taken once per step, never per
# replica. A step skipped for a non-finite gradient (nan_policy=skip, float16
# overflow) changes neither the weights nor the average.
#
# Only trainable variables are averaged: BatchNorm's moving statistics are
# already moving averages and are used as they are. The averages and their
# update count are checkpointed (`checkpoint_items`), so a resumed run
# continues the same average. Evaluation and the exported weights use the
# average (`swapped`); the checkpoints keep the raw weights that training
# continues from.
#
# With `warmup`, the decay of update n (from 0) is min(decay, (1 + n) /
# (10 + n)), as in `tf.train.ExponentialMovingAverage(num_updates=...)`: early
# averages forget the random initialisation quickly, which matters for runs of
# a few hundred steps.
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
