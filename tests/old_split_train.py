"""scripts/train.py as distloop saved a transformer split before
cross-mesh resume (commit 03c307a): the split optimizer itself as
`optimizer` (its own keys and shapes) and the split model's fingerprint in
run_config.json. For tests of resuming such a checkpoint; no binary files.
"""

import os
import runpy

from framework.model_parallel import tensor_parallel

# What the older TensorParallelTrainer lacked: its checkpoints held the
# optimizer itself, and a run recorded the architecture of `trainer.model`.
tensor_parallel.TensorParallelTrainer.checkpointed_optimizer = property(
    lambda self: self.optimizer)
tensor_parallel.TensorParallelTrainer.unsplit_model = property(
    lambda self: self.model)

runpy.run_path(os.path.join(os.path.dirname(__file__), os.pardir, "scripts",
                            "train.py"), run_name="__main__")
