"""Training-time augmentations for the `augment` hook of `framework.data.inputs`.

An augmentation is `(images [B, H, W, C] float, labels, seeds [B, 2]) ->
(images, labels)`. Each example's randomness comes from its own stateless seed,
so an example is augmented identically under every replica count, input mode
and restart (see `framework.data.inputs`).
"""

import tensorflow as tf

from framework.data.config import AUGMENTATIONS
from framework.errors import check_choice


def _per_example_ints(seeds, count, maxval):
  """[B, count] ints in [0, maxval), a pure function of each example's seed."""
  return tf.map_fn(
      lambda seed: tf.random.stateless_uniform(
          [count], seed=seed, maxval=maxval, dtype=tf.int32),
      seeds, fn_output_signature=tf.int32)


def crop_flip(images, labels, seeds, padding=4):
  """Random `padding`-pixel translation (zero padding) and horizontal flip.

  The standard CIFAR augmentation: pad each side by `padding`, crop back to
  the original size at a random offset, and mirror half of the images.
  """
  height, width = images.shape[1], images.shape[2]
  draws = _per_example_ints(seeds, 3, 2 * padding + 1)
  top, left, flip = draws[:, 0], draws[:, 1], draws[:, 2] % 2
  padded = tf.pad(images, [[0, 0], [padding, padding], [padding, padding],
                           [0, 0]])
  # Gather the crop window's rows, then its columns (mirrored when flipped).
  rows = top[:, None] + tf.range(height)[None, :]
  cols = left[:, None] + tf.range(width)[None, :]
  cols = tf.where(flip[:, None] == 1, tf.reverse(cols, axis=[1]), cols)
  cropped = tf.gather(padded, rows, axis=1, batch_dims=1)
  cropped = tf.gather(cropped, cols, axis=2, batch_dims=1)
  return cropped, labels


def flip(images, labels, seeds):
  """Horizontal flip of (on average) half of the images.

  For short schedules, where a random crop's extra variety costs more
  epochs than it returns.
  """
  mirrored = _per_example_ints(seeds, 1, 2)[:, 0] == 1
  return tf.where(mirrored[:, None, None, None],
                  tf.reverse(images, axis=[2]), images), labels


def get_augmentation(name):
  """The augmentation function for `name` (None for `none`)."""
  check_choice("augment", name, AUGMENTATIONS)
  return {"none": None, "flip": flip, "crop_flip": crop_flip}[name]
