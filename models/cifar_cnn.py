"""The seed CIFAR-10 CNN (1,676,982 parameters), layer for layer."""

import keras

from framework.settings import default
from models.options import ModelOptions
from models.registry import register


@register("cifar_cnn", task="classification")
def build(input_shape=(32, 32, 3), num_classes=10, *,
          dropout=default(ModelOptions, "dropout"),
          sync_batch_norm=default(ModelOptions, "sync_batch_norm")):
  """The seed network; outputs logits.

  Args:
    dropout: False leaves the Dropout layers out (for exact comparisons).
    sync_batch_norm: BatchNorm statistics over the global batch (all
      replicas) instead of each replica's part.
  """

  def batch_norm():
    return keras.layers.BatchNormalization(synchronized=sync_batch_norm)

  def drop(rate):
    return [keras.layers.Dropout(rate)] if dropout else []

  layers = [
      keras.Input(input_shape),
      batch_norm(),
      keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
      keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
      keras.layers.MaxPooling2D(2),
      *drop(0.25),
      batch_norm(),
      keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
      keras.layers.Conv2D(64, 3, padding="valid", activation="relu"),
      keras.layers.MaxPooling2D(2),
      *drop(0.25),
      keras.layers.Flatten(),
      keras.layers.Dense(512, activation="relu"),
      *drop(0.5),
      keras.layers.Dense(num_classes),
  ]
  return keras.Sequential(layers, name="cifar_cnn")
