"""Optimizers and learning-rate schedules by name.

The optimizers are plain Keras 3 optimizers; distloop never calls their
`apply_gradients` from a replica context (that would all-reduce a second
time), see `Trainer.apply_gradients`.
"""

import keras
import tensorflow as tf

# OptimizerConfig and the choices live in framework/core/config.py (no
# TensorFlow there: the flags are made from them); importable from here too.
from framework.core.config import (  # pylint: disable=unused-import
    DECAYING_SCHEDULES, LR_SCALINGS, OPTIMIZERS, SCHEDULES, OptimizerConfig)
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


class _Constant(keras.optimizers.schedules.LearningRateSchedule):

  def __init__(self, value):
    self.value = value

  def __call__(self, step):
    del step
    return tf.constant(self.value, tf.float32)

  def get_config(self):
    return {"value": self.value}


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
  if config.schedule == "cosine":
    check_positive("total_steps (for lr_schedule=cosine)", config.total_steps)
    after = keras.optimizers.schedules.CosineDecay(
        peak, decay_steps=max(config.total_steps - config.warmup_steps, 1),
        alpha=config.min_lr_ratio)
    shifted = lambda step: after(tf.maximum(step - config.warmup_steps, 0))
    return WarmupSchedule(shifted, config.warmup_steps)
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
