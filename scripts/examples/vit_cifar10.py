"""keras-io's "Image classification with Vision Transformer", ported at a
small size: patches of 4x4 of the 32x32 CIFAR-10 images, width 64, 4 heads,
4 transformer layers, AdamW.

    python scripts/examples/vit_cifar10.py --data_dir=cifar-10-batches-py \
        --strategy=mirrored --cpu_devices=2 --global_batch_size=64 \
        --train_steps=500 --model_dir=/tmp/vit

This file runs as train.py does, with `--model=vit_cifar10:build
--dataset=cifar10 --optimizer=adamw --learning_rate=1e-3
--weight_decay=1e-4` (keras-io's) as defaults; every train.py flag works
(`--dataset=synthetic` needs no data; `--num_heads`, and
`--model_options=transformer_layers=8,...` size the model). keras-io adapts the augmentation's `Normalization` on
`x_train` before it builds the model; here the builder leaves it unadapted
and the run adapts it on its first training batches (`--adapt_examples`),
once: the checkpoints keep its mean and variance. The random augmentation
layers (flip, rotation, zoom) draw from their SeedGenerators, whose states
the checkpoints keep too.
"""

import os
import sys

if __name__ == "__main__":
  # The installed package only (`pip install -e .`): a copy of this file
  # runs from any folder.
  from distloop_cli import cli  # pylint: disable=g-import-not-at-top
  cli.quiet_startup()  # Before TensorFlow is imported: quiet logs.
  cli.import_tensorflow_quietly()  # This module imports it right away.

import keras  # pylint: disable=g-import-not-at-top
from keras import layers  # pylint: disable=g-import-not-at-top
from keras import ops  # pylint: disable=g-import-not-at-top

from framework import settings  # pylint: disable=g-import-not-at-top
from models import options  # pylint: disable=g-import-not-at-top


class Patches(layers.Layer):
  """keras-io's: images [B, H, W, C] to patches [B, patches, size*size*C]."""

  def __init__(self, patch_size, **kwargs):
    super().__init__(**kwargs)
    self.patch_size = patch_size

  def call(self, images):
    input_shape = ops.shape(images)
    batch_size, height, width, channels = (input_shape[0], input_shape[1],
                                           input_shape[2], input_shape[3])
    num_patches_h = height // self.patch_size
    num_patches_w = width // self.patch_size
    patches = keras.ops.image.extract_patches(images, size=self.patch_size)
    return ops.reshape(patches, (
        batch_size, num_patches_h * num_patches_w,
        self.patch_size * self.patch_size * channels))

  def get_config(self):
    config = super().get_config()
    config.update({"patch_size": self.patch_size})
    return config


class PatchEncoder(layers.Layer):
  """keras-io's: a linear projection of each patch plus a learned position
  embedding."""

  def __init__(self, num_patches, projection_dim, **kwargs):
    super().__init__(**kwargs)
    self.num_patches = num_patches
    self.projection_dim = projection_dim
    self.projection = layers.Dense(units=projection_dim)
    self.position_embedding = layers.Embedding(input_dim=num_patches,
                                               output_dim=projection_dim)

  def call(self, patch):
    positions = ops.expand_dims(
        ops.arange(start=0, stop=self.num_patches, step=1), axis=0)
    return self.projection(patch) + self.position_embedding(positions)

  def get_config(self):
    config = super().get_config()
    config.update({"num_patches": self.num_patches,
                   "projection_dim": self.projection_dim})
    return config


def mlp(x, hidden_units, dropout_rate):
  """keras-io's: Dense(gelu) + Dropout per width."""
  for units in hidden_units:
    x = layers.Dense(units, activation=keras.activations.gelu)(x)
    x = layers.Dropout(dropout_rate)(x)
  return x


def augmentation(resize_to):
  """keras-io's `data_augmentation` (keras-io's `image_size` is
  `resize_to`), its `Normalization` unadapted (the run adapts it)."""
  return keras.Sequential([
      layers.Normalization(),
      layers.Resizing(resize_to, resize_to),
      layers.RandomFlip("horizontal"),
      layers.RandomRotation(factor=0.02),
      layers.RandomZoom(height_factor=0.2, width_factor=0.2),
  ], name="data_augmentation")


def build(input_shape, num_classes, resize_to=32, patch_size=4,
          projection_dim=64,
          num_heads=settings.default(options.ModelOptions, "num_heads"),
          transformer_layers=4, mlp_head_units=(256, 128)):
  """keras-io's `create_vit_classifier` (logits), small by default (4
  heads); keras-io uses resize_to (its image_size)=72, patch_size=6,
  transformer_layers=8, mlp_head_units=(2048, 1024). `--num_heads` sets
  the heads, `--model_options` the rest."""
  num_patches = (resize_to // patch_size) ** 2
  transformer_units = [projection_dim * 2, projection_dim]
  inputs = keras.Input(shape=input_shape)
  augmented = augmentation(resize_to)(inputs)
  patches = Patches(patch_size)(augmented)
  encoded_patches = PatchEncoder(num_patches, projection_dim)(patches)
  for _ in range(transformer_layers):
    x1 = layers.LayerNormalization(epsilon=1e-6)(encoded_patches)
    attention_output = layers.MultiHeadAttention(
        num_heads=num_heads, key_dim=projection_dim, dropout=0.1)(x1, x1)
    x2 = layers.Add()([attention_output, encoded_patches])
    x3 = layers.LayerNormalization(epsilon=1e-6)(x2)
    x3 = mlp(x3, hidden_units=transformer_units, dropout_rate=0.1)
    encoded_patches = layers.Add()([x3, x2])
  representation = layers.LayerNormalization(epsilon=1e-6)(encoded_patches)
  representation = layers.Flatten()(representation)
  representation = layers.Dropout(0.5)(representation)
  features = mlp(representation, hidden_units=[int(u) for u in mlp_head_units],
                 dropout_rate=0.5)
  logits = layers.Dense(num_classes)(features)
  return keras.Model(inputs=inputs, outputs=logits, name="vit")


def _run():
  """train.py with this file's defaults."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  from distloop_cli import train  # pylint: disable=g-import-not-at-top
  FLAGS = flags.FLAGS  # pylint: disable=invalid-name
  FLAGS.set_default("model", "vit_cifar10:build")
  FLAGS.set_default("dataset", "cifar10")
  FLAGS.set_default("optimizer", "adamw")
  FLAGS.set_default("learning_rate", 1e-3)
  FLAGS.set_default("weight_decay", 1e-4)

  def main(argv):
    del argv
    train.run_main()

  cli.run_app(main)


if __name__ == "__main__":
  # This folder on sys.path: --model=vit_cifar10:build imports this file.
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  _run()
