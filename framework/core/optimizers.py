"""Optimizers and learning-rate schedules by name.

The optimizers are plain Keras 3 optimizers; distloop never calls their
`apply_gradients` from a replica context (that would all-reduce a second
time), see `Trainer.apply_gradients`.
"""

import dataclasses

import keras
import tensorflow as tf

from framework.errors import ConfigError, check_choice, check_positive

OPTIMIZERS = ("sgd", "momentum", "adam", "adamw")
SCHEDULES = ("constant", "cosine", "step", "linear", "onecycle")
# Schedules whose length is the run's (total_steps filled in when 0).
DECAYING_SCHEDULES = ("cosine", "linear", "onecycle")
LR_SCALINGS = ("none", "linear", "sqrt")
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


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """What `make_optimizer` builds.

  Attributes:
    name: one of OPTIMIZERS; `momentum` is SGD with `momentum`.
    learning_rate: the peak learning rate.
    schedule: `constant`, `cosine` (to `min_lr_ratio` × peak at `total_steps`),
      `step` (× `step_decay` at each of `step_boundaries`), `linear` (after
      the warm-up, a straight line from the peak to `min_lr_ratio` × peak at
      `total_steps`) or `onecycle` (a triangle: `linear` whose warm-up, when
      `warmup_steps` is 0, is the first ONECYCLE_RISE (30 %) of the run).
    warmup_steps: linear warm-up length (from ~0 to the peak), 0 for none.
    total_steps: length of the cosine / linear / onecycle schedule.
    weight_decay: decoupled weight decay for `adamw`.
    nesterov: Nesterov momentum for `momentum` (one fused kernel too).
    lr_scaling: `none`, `linear` or `sqrt`: the peak `learning_rate` is for
      a global batch of `base_batch_size`; `scaled(global_batch_size)` scales
      it by (global / base) or its square root (Goyal et al., 2017).
    base_batch_size: the batch `learning_rate` was tuned for.
  """
  name: str = "adam"
  learning_rate: float = 1e-3
  momentum: float = 0.9
  weight_decay: float = 1e-4
  schedule: str = "constant"
  warmup_steps: int = 0
  total_steps: int = 0
  step_boundaries: tuple = ()
  step_decay: float = 0.1
  min_lr_ratio: float = 0.0
  nesterov: bool = False
  lr_scaling: str = "none"
  base_batch_size: int = 256

  def __post_init__(self):
    check_choice("optimizer", self.name, OPTIMIZERS)
    check_choice("lr_schedule", self.schedule, SCHEDULES)
    check_choice("lr_scaling", self.lr_scaling, LR_SCALINGS)
    check_positive("lr_base_batch_size", self.base_batch_size)
    if self.nesterov and self.name != "momentum":
      raise ConfigError(f"nesterov=True needs optimizer=momentum (got "
                        f"optimizer={self.name})")
    if not 0 <= self.min_lr_ratio <= 1:
      raise ConfigError(f"min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
    if not self.learning_rate > 0:
      raise ConfigError(f"learning_rate={self.learning_rate} must be > 0")
    if self.warmup_steps < 0:
      raise ConfigError(f"warmup_steps={self.warmup_steps} must be >= 0")
    if self.total_steps < 0:  # 0: filled in from the run's length (cosine)
      raise ConfigError(f"total_steps={self.total_steps} must be >= 0")
    if self.schedule == "step" and not self.step_boundaries:
      raise ConfigError("lr_schedule=step needs lr_step_boundaries, e.g. "
                        "'5000,8000'")
    if list(self.step_boundaries) != sorted(set(self.step_boundaries)):
      raise ConfigError(f"lr_step_boundaries={list(self.step_boundaries)} "
                        "must be strictly increasing")


  def scaled(self, global_batch_size):
    """This config with `learning_rate` scaled for `global_batch_size`."""
    ratio = global_batch_size / self.base_batch_size
    factor = {"none": 1.0, "linear": ratio, "sqrt": ratio**0.5}[
        self.lr_scaling]
    return dataclasses.replace(self, learning_rate=self.learning_rate * factor,
                               lr_scaling="none")


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
