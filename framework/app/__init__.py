"""Runs from a config: the settings (config), a run's plan, its build
(factory) and the run path (experiment), export, evaluation, prediction.
"""

import importlib
import importlib.util


def __getattr__(name):
  # Submodules load on first use (PEP 562), so that the documented dotted
  # names (`framework.app.experiment.run`) work after `import framework`
  # without importing every module, and TensorFlow, up front.
  if not importlib.util.find_spec(f"{__name__}.{name}"):
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  return importlib.import_module(f"{__name__}.{name}")
