"""Model builders by name: `build_model("cifar_cnn", (32, 32, 3), 10)`.

Importing `models` loads no TensorFlow: the built-in builders (and the gpt
split) register when a name is first looked up (`registry.get_builder`)
or a builder module is read (`models.mlp`), and `models.options` (the
built-in models' options, from which the flags are made) stays light.
"""

import importlib

from models import registry
from models.registry import (build_model, check_task, get_builder,
                             model_names, register)

__all__ = ["build_model", "check_task", "get_builder", "model_names",
           "register"]


def __getattr__(name):
  """The built-in builder modules (`models.mlp`, ...), loaded on first use."""
  if name in registry.BUILTIN_MODULES:
    registry.load_builtin()
    return importlib.import_module(f"models.{name}")
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
