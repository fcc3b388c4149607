"""Test-time augmentation (TTA) for evaluation.

`flip`: the model's logits on each image and on its horizontal mirror,
averaged (the mean of the logits, as in the airbench CIFAR-10 speedruns,
rather than the mean of the probabilities: one less softmax and the same
arg-max in practice). For per-pixel outputs ([B, H, W, K]) the mirrored
view's logits are mirrored back first, so that each pixel's two
predictions are averaged.

It is per example, so it is exact under every strategy and for a partial
last batch: both views go through the model as one batch of 2B in inference
mode (BatchNorm uses its moving statistics), then split.
"""

import tensorflow as tf

from framework.core.config import TTA_MODES
from framework.errors import check_choice


def check_tta(mode):
  check_choice("eval_tta", mode, TTA_MODES)
  return mode


def flip_logits(model, images):
  """float32 mean of `model`'s logits on `images` [B, H, W, C] and on their
  horizontal mirrors."""
  mirrored = tf.reverse(images, axis=[2])
  both = tf.cast(model(tf.concat([images, mirrored], 0), training=False),
                 tf.float32)
  plain, flipped = tf.split(both, 2, axis=0)
  if flipped.shape.rank == 4:  # per pixel: mirror the prediction back
    flipped = tf.reverse(flipped, axis=[2])
  return 0.5 * (plain + flipped)


def eval_logits(model, features, mode):
  """The model's evaluation outputs under TTA `mode`."""
  if mode == "flip":
    return flip_logits(model, features)
  return model(features, training=False)
