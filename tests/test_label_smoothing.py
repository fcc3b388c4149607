"""Label smoothing: per-example losses equal Keras's smoothed cross-entropy."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from framework import ConfigError
from framework.core.trainer import smoothed_sparse_categorical_loss
from framework.core.trainer import sparse_categorical_loss


@pytest.mark.parametrize("smoothing", [0.0, 0.1, 0.2])
def test_equals_keras_categorical_crossentropy_per_example(smoothing):
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(7, 10)).astype(np.float32) * 3
  labels = rng.integers(0, 10, size=7)
  reference = keras.losses.CategoricalCrossentropy(
      from_logits=True, label_smoothing=smoothing, reduction=None)(
          tf.one_hot(labels, 10), logits)
  ours = smoothed_sparse_categorical_loss(smoothing)(labels, logits)
  assert ours.shape == (7,)
  np.testing.assert_allclose(ours.numpy(), reference.numpy(), rtol=1e-5,
                             atol=1e-6)
  if smoothing == 0:
    np.testing.assert_allclose(
        ours.numpy(), sparse_categorical_loss(labels, logits).numpy(),
        rtol=1e-5)


def test_per_pixel_labels_and_bfloat16_logits():
  rng = np.random.default_rng(1)
  logits = rng.normal(size=(2, 3, 4, 5)).astype(np.float32)
  labels = rng.integers(0, 5, size=(2, 3, 4))
  reference = keras.losses.CategoricalCrossentropy(
      from_logits=True, label_smoothing=0.2, reduction=None)(
          tf.one_hot(labels, 5), logits)
  ours = smoothed_sparse_categorical_loss(0.2)(labels, tf.constant(logits))
  np.testing.assert_allclose(ours.numpy(), reference.numpy(), rtol=1e-5)
  low = smoothed_sparse_categorical_loss(0.2)(
      labels, tf.cast(logits, tf.bfloat16))
  assert low.dtype == tf.float32


@pytest.mark.parametrize("smoothing", [-0.1, 1.0])
def test_bad_smoothing_is_rejected(smoothing):
  with pytest.raises(ConfigError, match="label_smoothing"):
    smoothed_sparse_categorical_loss(smoothing)
