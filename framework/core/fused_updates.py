"""One fused kernel per variable for the optimizer update.

Keras 3 optimizers are written once for every backend, so `Adam.update_step`
is about a dozen element-wise ops, each a separate pass over the variable
or its slots. TensorFlow has had the whole update as one kernel since TF 1
(`ResourceApplyAdam`, `ResourceApplyKerasMomentum`,
`ResourceApplyGradientDescent`): the same formula, one pass. Because the
Trainer owns the update (see `Trainer.apply_gradients`), it can use them:

    update = fused_update(optimizer)   # None: use optimizer.update_step
    update(grad, var, learning_rate)   # inside strategy.extended.update

The state stays the optimizer's own slot variables, so checkpoints, Keras's
`update_step` and these kernels are interchangeable at any step.
"""

import keras
import tensorflow as tf

from framework import _tf_internal


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
