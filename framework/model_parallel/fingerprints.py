"""Fingerprints of tensors' bits, computed where the tensors are: whether
two copies of a variable on different devices are equal, with only a
[2]-vector crossing between the devices (`PipelineCopies.sync_copies`,
`CopyParameterSharding.load`).

A tensor's bits are cut into 16-bit limbs `x_j` (`tf.bitcast`; 8-bit for
1-byte dtypes), and its fingerprint is

    [sum_j (j+1) x_j mod p,  sum_j (j+1)^2 x_j mod p],  p = 2^31 - 1 (prime)

Two tensors whose limbs differ in at most 2 positions (a float32 element,
say) always differ in it: a nonzero difference d (|d| < 2^16 < p) at 1 or 2
positions solves no 2 x 2 Vandermonde system mod p (positions + 1 are
distinct and nonzero mod p below 2^31 - 1 limbs). Other changes collide
with a chance of about 1/p^2 (2^-62) when their bits are unrelated to the
weights.

What it relies on: int64 arithmetic on non-negative values below 2^63
(every product is below 2^62 and a chunk's sum below 2^51; no overflow, so
no host's wrap-around semantics), and `tf.bitcast` giving the same limbs on
every device (hosts of one byte order). A tensor of more than `CHUNK` limbs
is summed a chunk at a time in a `tf.while_loop`, which bounds the int64
temporaries (about 40 bytes a limb) to a chunk's; an empty tensor is
never fingerprinted (callers skip it: there is nothing to copy).
"""

import tensorflow as tf

PRIME = 2**31 - 1
CHUNK = 2**20  # limbs summed at once


def _limbs(value):
  """`value`'s bits as a flat vector of 16-bit (1-byte dtypes: 8-bit)
  unsigned integers, in the host's byte order."""
  value = tf.reshape(tf.convert_to_tensor(value), [-1])
  if value.dtype == tf.bool:
    value = tf.cast(value, tf.uint8)
  if value.dtype.size == 1:
    limbs = value if value.dtype == tf.uint8 else tf.bitcast(value, tf.uint8)
  elif value.dtype == tf.uint16:
    limbs = value
  else:
    limbs = tf.bitcast(value, tf.uint16)  # [n, size / 2]
  return tf.reshape(limbs, [-1])


def _sums(limbs, start):
  """[2] int64: the chunk `limbs` (from position `start`, an int64 scalar)
  weighted by (j+1) and (j+1)^2 mod p, summed mod p."""
  count = tf.size(limbs, out_type=tf.int64)
  # Positions wrap at p - 1 only past 2^31 - 2 limbs (8 GiB of weights in
  # one tensor), where the 2-limb guarantee ends but nothing overflows.
  position = tf.math.floormod(start + tf.range(count, dtype=tf.int64),
                              PRIME - 1) + 1
  square = tf.math.floormod(position * position, PRIME)
  x = tf.cast(limbs, tf.int64)
  first = tf.reduce_sum(tf.math.floormod(position * x, PRIME))
  second = tf.reduce_sum(tf.math.floormod(square * x, PRIME))
  return tf.math.floormod(tf.stack([first, second]), PRIME)


def fingerprint(value, chunk=CHUNK):
  """[2] int64 in [0, 2^31 - 1): the fingerprint of `value`'s bits (see the
  module's docstring), computed on the current device.

  Args:
    value: a tensor (or variable) with at least one element.
    chunk: the most limbs summed at once (the loop's step).
  """
  limbs = _limbs(value)
  count = limbs.shape.num_elements()
  if count is None:
    raise ValueError("fingerprint needs a static shape")
  if count <= chunk:
    return _sums(limbs, tf.constant(0, tf.int64))
  steps = -(-count // chunk)

  def body(i, total):
    start = tf.cast(i, tf.int64) * chunk
    part = limbs[i * chunk:tf.minimum((i + 1) * chunk, count)]
    return i + 1, tf.math.floormod(total + _sums(part, start), PRIME)

  _, total = tf.while_loop(
      lambda i, _: i < steps, body,
      (tf.constant(0), tf.zeros([2], tf.int64)), parallel_iterations=1)
  return total


def differs(a, b):
  """A bool scalar: fingerprints `a` and `b` differ (on the current
  device)."""
  return tf.reduce_any(tf.not_equal(a, b))
