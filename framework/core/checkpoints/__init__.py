"""Checkpoints and resume: one package, reached from the loop by one name.

    manager = for_loop(parts, model_dir, restore_policy="latest_intact",
                       run_config=..., allow_config_change=False)
    Controller(trainer, config, model_dir, parts=parts, checkpoints=manager)

`CheckpointManager` (`manager.py`: save, restore, the state file, the
integrity checks, the configuration checked on resume) is the seam the
loop saves and restores through; `for_loop` builds the one a Controller
uses (its checkpoint holds `parts.checkpoint`); `checkpoint_objects(trainer)`
is what a run's checkpoint holds of a trainer. Beside it: `best.py`
(best/ and early stopping), `warm_start.py` (initialising from another
run) and `run_files.py` (atomic writes, the run lock, the run state).
"""

import importlib
import importlib.util

from framework.core.checkpoints.manager import (
    CheckpointManager, checkpoint_items, checkpoint_objects, for_loop)


def __getattr__(name):
  # The other modules (`best`, `warm_start`, `run_files`) load on first use
  # (PEP 562), so their documented dotted names work after `import framework`.
  if not importlib.util.find_spec(f"{__name__}.{name}"):
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  return importlib.import_module(f"{__name__}.{name}")
