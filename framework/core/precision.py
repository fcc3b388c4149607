"""Mixed precision: the Keras dtype policy and a loss scale for float16.

    bfloat16: compute in bfloat16, keep float32 variables; same exponent range
              as float32, so no loss scaling is needed.
    float16:  compute in float16; small gradients underflow, so the loss is
              multiplied by a scale S before differentiation and the gradients
              are divided by S *after* the explicit all-reduce:

    grads = all_reduce_sum(d (S * loss_share) / d weights) / S
    if not all finite(grads): skip the update;  S = S / 2
    else: update;  after `growth_interval` good steps in a row: S = S * 2

The reduced gradient is identical on every replica, so every replica makes the
same skip decision and the scale stays equal everywhere (it is updated in the
cross-replica context of `Trainer.apply_gradients`).
"""

from absl import logging
import keras
import tensorflow as tf

from framework.core.config import PRECISION_CHOICES, PRECISIONS
from framework.errors import ConfigError, check_choice, check_positive

# CPU flags (Linux /proc/cpuinfo) of native bfloat16 matrix arithmetic: with
# them oneDNN's bfloat16 convolutions beat float32 (1.6-1.7x measured on the
# seed CNN); without them bfloat16 is emulated and slower.
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_flags(cpuinfo="/proc/cpuinfo"):
  """The CPU feature flags the kernel reports (empty where unknown)."""
  try:
    with open(cpuinfo) as f:
      for line in f:
        if line.startswith("flags"):
          return set(line.split(":", 1)[1].split())
  except OSError:
    pass
  return set()


def _gpu_has_bfloat16():
  """Whether every visible GPU computes bfloat16 natively (Ampere, 8.0+)."""
  gpus = tf.config.list_physical_devices("GPU")
  if not gpus:
    return None
  capabilities = [tf.config.experimental.get_device_details(g).get(
      "compute_capability", (0, 0)) for g in gpus]
  return all(tuple(c) >= (8, 0) for c in capabilities)


def resolve_precision(precision, *, flags=None, gpu_bfloat16="detect"):
  """`precision`, with `auto` replaced by what pays on this machine.

  `auto` is bfloat16 on GPUs with native bfloat16 (compute capability
  8.0+), or without a GPU on CPUs with AVX512_BF16 or AMX-BF16; else
  float32. float16 is never chosen: it needs loss scaling.

  Args:
    precision: one of PRECISION_CHOICES.
    flags: CPU flags to decide by (default: this machine's).
    gpu_bfloat16: True/False/None (no GPU) instead of detecting.
  """
  check_choice("mixed_precision", precision, PRECISION_CHOICES)
  if precision != "auto":
    return precision
  gpu = _gpu_has_bfloat16() if gpu_bfloat16 == "detect" else gpu_bfloat16
  if gpu is not None:
    chosen, why = ("bfloat16" if gpu else "float32"), (
        "GPU " + ("with" if gpu else "without") + " native bfloat16")
  else:
    found = sorted(set(BF16_CPU_FLAGS) & set(
        cpu_flags() if flags is None else flags))
    chosen = "bfloat16" if found else "float32"
    why = ("CPU flags " + ", ".join(found) if found else
           f"CPU without {' or '.join(BF16_CPU_FLAGS)}")
  logging.info("mixed_precision=auto: %s (%s)", chosen, why)
  return chosen
_KERAS_POLICY = {"float32": "float32", "bfloat16": "mixed_bfloat16",
                 "float16": "mixed_float16"}


def _concrete(precision):
  # A resolved name is taken as it is: a run resolves `auto` once.
  return precision if precision in PRECISIONS else resolve_precision(precision)


def set_precision(precision):
  """Sets Keras's global dtype policy; call before building the model."""
  keras.mixed_precision.set_global_policy(_KERAS_POLICY[_concrete(precision)])


def needs_loss_scale(precision):
  return _concrete(precision) == "float16"


class LossScale:
  """A dynamic loss scale, mirrored on every replica of `strategy`.

  Args:
    strategy: the strategy whose replicas share the scale.
    initial_scale: the starting scale (a power of two keeps it exact).
    growth_interval: finite steps in a row before the scale doubles.
    factor: the scale is multiplied (divided) by this on growth (overflow).
  """

  def __init__(self, strategy, *, initial_scale=2.0**15, growth_interval=2000,
               factor=2.0):
    if not initial_scale > 0:
      raise ConfigError(f"initial_scale={initial_scale} must be > 0")
    check_positive("growth_interval", growth_interval)
    if not factor > 1:
      raise ConfigError(f"factor={factor} must be > 1")
    self.growth_interval = growth_interval
    self.factor = factor
    with strategy.scope():
      self.scale = tf.Variable(
          initial_scale, dtype=tf.float32, trainable=False, name="loss_scale",
          aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
      self.good_steps = tf.Variable(
          0, dtype=tf.int64, trainable=False, name="loss_scale_good_steps",
          aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)

  def scale_loss(self, loss):
    """`loss * S`, in the loss's dtype."""
    return loss * tf.cast(self.scale, loss.dtype)

  def unscale(self, grads):
    """`grads / S` in float32 (call on the all-reduced gradients)."""
    inverse = 1.0 / tf.identity(self.scale)
    return [None if g is None else tf.cast(g, tf.float32) * inverse
            for g in grads]

  def update(self, finite):
    """Adjusts S after a step (cross-replica); `finite`: the step applied."""

    def grow_or_count():
      grow = self.good_steps + 1 >= self.growth_interval
      return tf.group(
          self.scale.assign(tf.where(grow, self.scale * self.factor,
                                     self.scale)),
          self.good_steps.assign(tf.where(grow, tf.constant(0, tf.int64),
                                          self.good_steps + 1)))

    def shrink():
      return tf.group(
          self.scale.assign(tf.maximum(self.scale / self.factor, 1.0)),
          self.good_steps.assign(0))

    return tf.cond(finite, grow_or_count, shrink)

  def checkpoint_items(self):
    """Trackables to checkpoint so that a resumed run keeps its scale."""
    return {"loss_scale": self.scale,
            "loss_scale_good_steps": self.good_steps}
