"""A function that is no model function (Python's own) is one line, and a
subclassed model (no static output shape) builds."""

import keras
import pytest

from framework.errors import ConfigError
from models import registry


@pytest.mark.parametrize("name", ["builtins:eval", "builtins:exec",
                                  "os.path:join", "operator:add",
                                  "collections:namedtuple"])
def test_pythons_own_functions_are_one_line(name):
  with pytest.raises(ConfigError) as error:
    registry.build_model(name, (4,), 2)
  assert "cannot be called as build(input_shape, num_classes" in str(
      error.value)


def user_bug(input_shape, num_classes):
  return len(5)  # the user's own TypeError: their traceback, not ours


def test_a_type_error_inside_ones_own_function_is_its_own():
  with pytest.raises(TypeError, match="has no len"):
    registry.build_model(f"{__name__}:user_bug", (4,), 2)


class _Subclassed(keras.Model):

  def __init__(self, num_classes):
    super().__init__()
    self.dense = keras.layers.Dense(num_classes)

  def call(self, x):
    return self.dense(x)


def subclassed(input_shape, num_classes):
  model = _Subclassed(num_classes)
  model(keras.ops.zeros((1, *input_shape)))
  return model


def test_a_subclassed_model_passes_the_task_check():
  model = registry.build_model(f"{__name__}:subclassed", (4,), 2)
  registry.check_task(f"{__name__}:subclassed", False, "numpy", model=model)
