"""U-Net: an encoder-decoder with skip connections, for per-pixel classes.

The default (depth 4, width 32, 128x128x3 inputs, 3 classes) is the
Oxford-IIIT Pet trimap task; tests use a shallow, narrow one on small images.
Built from scratch: no pretrained weights are downloaded.
"""

import keras

from framework.errors import ConfigError
from framework.settings import default
from models.options import ModelOptions
from models.registry import register


def _conv_block(x, filters, sync_batch_norm):
  """Two 3x3 conv -> BatchNorm -> ReLU: the unit of every level."""
  for _ in range(2):
    x = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False)(x)
    x = keras.layers.BatchNormalization(
        momentum=0.9, synchronized=sync_batch_norm)(x)
    x = keras.layers.ReLU()(x)
  return x


@register("unet", task="segmentation")
def build(input_shape=(128, 128, 3), num_classes=3, *,
          depth=default(ModelOptions, "depth"),
          width=default(ModelOptions, "width"),
          sync_batch_norm=default(ModelOptions, "sync_batch_norm")):
  """A U-Net returning per-pixel logits [batch, height, width, num_classes].

  Args:
    depth: down-sampling levels; height and width must be multiples of
      2**depth.
    width: filters of the first level; each level down doubles them.
    sync_batch_norm: BatchNorm statistics over all replicas.
  """
  if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
    raise ConfigError(f"unet depth={depth!r} must be an integer >= 1")
  if isinstance(width, bool) or not isinstance(width, int) or width < 1:
    raise ConfigError(f"unet width={width!r} must be an integer >= 1")
  height, columns = input_shape[0], input_shape[1]
  if len(input_shape) != 3 or height % 2**depth or columns % 2**depth:
    raise ConfigError(
        f"unet input_shape={tuple(input_shape)} must be (height, width, "
        f"channels) with height and width multiples of 2**depth={2**depth}")
  inputs = keras.Input(input_shape)
  x, skips = inputs, []
  # Encoder: each level keeps its features for the decoder, then halves.
  for level in range(depth):
    x = _conv_block(x, width * 2**level, sync_batch_norm)
    skips.append(x)
    x = keras.layers.MaxPooling2D(2)(x)
  x = _conv_block(x, width * 2**depth, sync_batch_norm)
  # Decoder: upsample, then join the encoder's full-resolution detail.
  for level in reversed(range(depth)):
    x = keras.layers.Conv2DTranspose(width * 2**level, 2, strides=2,
                                     padding="same")(x)
    x = keras.layers.Concatenate()([x, skips[level]])
    x = _conv_block(x, width * 2**level, sync_batch_norm)
  logits = keras.layers.Conv2D(num_classes, 1)(x)
  return keras.Model(inputs, logits, name="unet")
