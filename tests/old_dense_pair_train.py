"""scripts/train.py as distloop saved a Dense pair tensor split before it
saved the unsplit model's keys: the split model's own keys (its `column`,
`row`), the split optimizer itself as `optimizer` and the split model's
fingerprint in run_config.json. Checked once against a run of that code
(commit 8b9272b): the same checkpoint, byte for byte. For tests of
resuming such a folder; no binary files.
"""

import os
import runpy

from framework.model_parallel import tensor_parallel

_init = tensor_parallel.CheckpointLayout.__init__


def _own_keys(layout):
  _init(layout)
  layout.own_keys = True  # saved, not only read, under the split's keys


tensor_parallel.CheckpointLayout.__init__ = _own_keys
tensor_parallel.TensorParallelTrainer.unsplit_model = property(
    lambda self: self.model)

runpy.run_path(os.path.join(os.path.dirname(__file__), os.pardir, "scripts",
                            "train.py"), run_name="__main__")
