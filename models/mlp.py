"""A small MLP for tests, equivalence checks and model parallelism."""

import keras

from models.registry import register


@register("mlp")
def build(input_shape, num_classes, *, hidden_units=(64, 64)):
  """Flatten, then Dense-ReLU per entry of `hidden_units`, then logits."""
  layers = [keras.Input(input_shape), keras.layers.Flatten()]
  layers += [keras.layers.Dense(units, activation="relu")
             for units in hidden_units]
  layers.append(keras.layers.Dense(num_classes))
  return keras.Sequential(layers, name="mlp")
