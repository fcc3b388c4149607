"""Checkpoints and resume: one package, reached from the loop by one name.

    manager = CheckpointManager(checkpoint, model_dir, strategy)

`manager` (`CheckpointManager`: save, restore, the state file, integrity
checks) is the seam the loop writes through; `best` (best/ and early
stopping), `warm_start` (initialising from another run) and `run_files`
(atomic writes, the run lock, the run state) sit beside it.
"""

from framework.core.checkpoints.manager import CheckpointManager
