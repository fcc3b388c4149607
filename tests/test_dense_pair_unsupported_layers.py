"""A Dense pair whose layers carry more than kernel, bias and activation
(no bias, a regulariser, a constraint) is refused by the tensor split in
one ConfigError naming the layer and the option, not split with them
silently dropped (other numbers than the unsplit model) nor a traceback.
"""

import keras
import pytest

from framework.errors import ConfigError
from framework.model_parallel import split_dense_pair


def _model(first=None, second=None):
  return keras.Sequential([
      keras.Input((6,)),
      keras.layers.Dense(4, activation="relu", **(first or {})),
      keras.layers.Dense(3, **(second or {}))])


@pytest.mark.parametrize("first, second, named", [
    ({"use_bias": False}, None, "use_bias=False"),
    (None, {"use_bias": False}, "use_bias=False"),
    ({"kernel_regularizer": "l2"}, None, "kernel_regularizer=L2"),
    (None, {"bias_regularizer": "l1"}, "bias_regularizer=L1"),
    ({"activity_regularizer": "l2"}, None, "activity_regularizer=L2"),
    (None, {"kernel_constraint": "non_neg"}, "kernel_constraint=NonNeg"),
])
def test_is_one_config_error_naming_the_option(first, second, named):
  with pytest.raises(ConfigError, match=named):
    split_dense_pair(_model(first, second), 0, ["/CPU:0", "/CPU:0"])


def test_a_plain_pair_splits():
  model = _model()
  placed = split_dense_pair(model, 0, ["/CPU:0", "/CPU:0"])
  assert len(placed.column.shards) == 2


def test_a_functional_model_is_refused_as_a_tensor_split():
  # Not "pipeline parallelism needs ...": the user asked for a tensor split.
  inputs = keras.Input((6,))
  outputs = keras.layers.Dense(3)(keras.layers.Dense(4)(inputs))
  with pytest.raises(ConfigError, match=r"^tensor parallelism .* needs a "
                     r"keras.Sequential model .* got Functional"):
    split_dense_pair(keras.Model(inputs, outputs), 0, ["/CPU:0", "/CPU:0"])
