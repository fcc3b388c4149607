"""The loop: Trainer (one step's math), Controller (the outer loop), the
protocols between them, evaluation, actions, checkpoints (a package),
summaries, optimizers and ZeRO-1, precision and the parameter-server
stepping.
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
