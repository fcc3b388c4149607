"""Model builders found by name.

A builder is `build(input_shape, num_classes, **options) -> keras.Model` that
returns logits. `build_model` passes each builder only the options its
signature names, so one set of script flags serves every model.
"""

import inspect

from framework.errors import ConfigError

_BUILDERS = {}


def register(name):
  """Decorator: makes a builder available to `build_model(name, ...)`."""

  def wrap(builder):
    _BUILDERS[name] = builder
    return builder

  return wrap


def model_names():
  return sorted(_BUILDERS)


def get_builder(name):
  if name not in _BUILDERS:
    raise ConfigError(f"model={name!r} is unknown; known models: "
                      f"{', '.join(model_names())}")
  return _BUILDERS[name]


def build_model(name, input_shape, num_classes, **options):
  """Builds model `name`; options it does not take are ignored."""
  builder = get_builder(name)
  accepted = inspect.signature(builder).parameters
  return builder(tuple(input_shape), num_classes,
                 **{k: v for k, v in options.items() if k in accepted})
