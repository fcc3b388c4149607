"""A small MLP for tests, equivalence checks and model parallelism."""

import keras

from framework.errors import ConfigError
from framework.settings import default
from models.options import ModelOptions
from models.registry import register


@register("mlp", task="classification")
def build(input_shape, num_classes, *,
          hidden_units=default(ModelOptions, "hidden_units")):
  """Flatten, then Dense-ReLU per entry of `hidden_units`, then logits."""
  for units in hidden_units:
    if isinstance(units, bool) or not isinstance(units, int) or units < 1:
      raise ConfigError(f"mlp hidden_units={tuple(hidden_units)!r}: every "
                        f"layer size must be an integer >= 1 (got {units!r})")
  layers = [keras.Input(input_shape), keras.layers.Flatten()]
  layers += [keras.layers.Dense(units, activation="relu")
             for units in hidden_units]
  layers.append(keras.layers.Dense(num_classes))
  return keras.Sequential(layers, name="mlp")
