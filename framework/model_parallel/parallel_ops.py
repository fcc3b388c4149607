"""The two placed primitives of Megatron-style tensor parallelism.

A tensor-parallel model keeps one tensor per shard device (`[x_0, ...,
x_{D-1}]`, x_d on devices[d]) and runs each shard's math on its device.
`tf.GradientTape` does not put gradient ops next to their forward ops (they
land wherever `tape.gradient` runs), so both primitives place their
backward pass themselves, with `tf.custom_gradient`:

    on_device(device, fn, *xs)   forward fn(*xs) on `device`, recorded on a
                                 tape of its own; backward that tape's
                                 gradient, also on `device`
    all_reduce([p_0, ...])       forward: sum_d p_d on every device
                                 (TensorFlow's collective all-reduce, one
                                 CollectiveReduceV2 per device);
                                 backward: the same all-reduce of the
                                 incoming gradients

The all-reduce's backward is the exact gradient of "every device gets the
sum" (d p_e = sum_d d s_d), so the whole split model is an ordinary
differentiable function and a variable read on several devices (a
replicated layer norm) just gets the sum of its per-device gradients. One
transformer sub-layer (attention or MLP) then costs one all-reduce forward
and one backward, as Megatron's f/g pair does.
"""

import contextlib

import tensorflow as tf

from framework.model_parallel.replicas import SUM, collective_all_reduce
from framework import _tf_internal


def on_device(device, fn, *inputs):
  """`fn(*inputs)` on `device`, forward and backward.

  Args:
    device: where the ops of `fn` and of its gradient run.
    fn: `(*tensors) -> tensor or tuple of tensors`; may read variables
      (their gradients are returned to the enclosing tape).
    *inputs: float tensors (integers, e.g. token ids, are closed over by
      `fn` instead: they have no gradient).
  """

  @tf.custom_gradient
  def block(*xs):
    with tf.device(device):
      with tf.GradientTape() as tape:
        # One copy onto this device, watched, instead of one per consumer.
        local = [tf.identity(x) for x in xs]
        tape.watch(local)
        outputs = fn(*local)
    flat = tf.nest.flatten(outputs)

    def grad(*output_grads, variables=None):
      variables = list(variables or [])
      with tf.device(device):
        grads = tape.gradient(
            flat, local + variables, output_gradients=list(output_grads),
            unconnected_gradients=tf.UnconnectedGradients.ZERO)
      return grads[:len(local)], grads[len(local):]

    return outputs, grad

  with tf.device(device):
    # Outputs that name their device (`vocab_parallel_statistics` reads it).
    return tf.nest.map_structure(tf.identity, block(*inputs))


def _sum_on_every_device(values, devices):
  """`sum(values)` on each of `devices` (value d already on devices[d])."""
  if len(values) == 1:
    return [tf.identity(values[0])]
  summed = collective_all_reduce(tuple(devices)).reduce(
      SUM, _tf_internal.per_replica(values),
      destinations=_tf_internal.per_replica(values))
  return list(summed.values)


def all_reduce(values, devices):
  """`[sum(values)] * D`, copy d on devices[d]; its gradient likewise.

  Args:
    values: D tensors of one shape, values[d] on devices[d].
    devices: the D shard devices (one collective group).
  """
  devices = tuple(devices)
  if len(values) != len(devices):
    raise ValueError(f"all_reduce got {len(values)} values for "
                     f"{len(devices)} devices")

  @tf.custom_gradient
  def reduce(*parts):
    def grad(*output_grads):
      return _sum_on_every_device(list(output_grads), devices)

    return tuple(_sum_on_every_device(list(parts), devices)), grad

  return list(reduce(*values))


def all_gather(values, devices):
  """`stack(values)` [D, ...] on every device (an all-reduce of one-hot
  placed copies: each device contributes its slot, zeros elsewhere)."""
  num = len(devices)
  placed = []
  for d, (value, device) in enumerate(zip(values, devices)):
    with tf.device(device):
      slot = tf.one_hot(d, num, dtype=value.dtype)
      placed.append(tf.reshape(slot, [num] + [1] * value.shape.rank) *
                    value[tf.newaxis])
  return all_reduce(placed, devices)


def maybe_device(devices):
  """`tf.device(devices[0])`, or no scope when `devices` is empty."""
  return tf.device(devices[0]) if devices else contextlib.nullcontext()
