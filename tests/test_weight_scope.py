"""`parallel_layers.on_device` under a `WeightScope` (ZeRO-3's joined
weights): the weights a placed block reads get their gradients, a block
reading none gets none, losses reach the scope, and nested blocks are
refused rather than losing gradients."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from framework.model_parallel.parallel_layers import WeightScope, on_device


class Scale(keras.layers.Layer):
  """y = x * kernel (+ an added loss when `penalty`)."""

  def __init__(self, penalty=False, **kwargs):
    super().__init__(**kwargs)
    self.penalty = penalty

  def build(self, input_shape):
    self.kernel = self.add_weight(shape=(input_shape[-1],),
                                  initializer="ones", name="kernel")

  def call(self, x):
    if self.penalty:
      self.add_loss(tf.reduce_sum(self.kernel))
    return x * self.kernel


def _layer(penalty=False):
  layer = Scale(penalty)
  layer.build((None, 3))
  return layer


def test_a_blocks_weight_gradient_reaches_the_tape():
  # Inside a tf.function, as the trainers' steps run: there a custom
  # gradient gives nothing to a tensor it closes over (eagerly the tape
  # also records the block's inner ops).
  layer = _layer()
  x = tf.constant([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
  weight = tf.constant([0.5, -1.0, 2.0])

  @tf.function(autograph=False)
  def step():
    with tf.GradientTape() as tape:
      tape.watch(weight)
      with WeightScope([layer.kernel], [weight]):
        y = on_device("/CPU:0", layer, x)
      loss = tf.reduce_sum(y * y)
    return y, tape.gradient(loss, weight)

  y, grad = step()
  np.testing.assert_allclose(y.numpy(), x.numpy() * weight.numpy())
  # d/dw sum((x w)^2) = sum over rows of 2 x^2 w.
  expected = np.sum(2 * x.numpy() ** 2 * weight.numpy(), axis=0)
  np.testing.assert_allclose(grad.numpy(), expected, rtol=1e-6)
  # The variable itself was not read (it still holds ones).
  np.testing.assert_array_equal(layer.kernel.numpy(), np.ones(3))


def test_a_block_that_reads_no_weight_gives_it_no_gradient():
  layer = _layer()
  x = tf.constant([[1.0, 2.0, 3.0]])
  weight = tf.constant([0.5, -1.0, 2.0])
  @tf.function(autograph=False)
  def step():
    with tf.GradientTape() as tape:
      tape.watch(weight)
      with WeightScope([layer.kernel], [weight]):
        y = on_device("/CPU:0", lambda x: x * 2.0, x)
    grad = tape.gradient(y, weight)
    assert grad is None  # traced: None, not a tensor of zeros
    return y

  step()


def test_a_blocks_losses_reach_the_collecting_scope():
  layer = _layer(penalty=True)
  weight = tf.constant([0.5, -1.0, 2.0])
  with WeightScope([layer.kernel], [weight], collect_losses=True) as scope:
    on_device("/CPU:0", layer, tf.ones((1, 3)))
  assert len(scope.losses) == 1
  np.testing.assert_allclose(float(scope.losses[0]), 1.5)


def test_nested_blocks_under_a_weight_scope_are_refused():
  layer = _layer()
  weight = tf.constant([0.5, -1.0, 2.0])

  def outer(x):
    return on_device("/CPU:0", layer, x)

  with WeightScope([layer.kernel], [weight]):
    with pytest.raises(ValueError, match="do not nest"):
      on_device("/CPU:0", outer, tf.ones((1, 3)))
