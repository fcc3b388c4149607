"""A transformer split's checkpoint from before its optimizer was saved as
an unsplit run's: restored as that split's, the next one saved as unsplit.

distloop before cross-mesh resume (before commit 54c2082) saved a
transformer split's optimizer under the split optimizer's own keys: its
per-variable lists (`optimizer/_trainable_variables/<i>`, the slots) in the
split model's variable order, one entry per shard. `OptimizerLayout` is
what checkpoints hold as `optimizer`: `split_checkpoint.unsplit_view`,
except inside `restoring_split()`, where it is the split optimizer itself,
so that the same split restores such a checkpoint exactly (weights and
slots); every later save is in the unsplit layout. `layout_of` tells the
two layouts apart by the shapes of the checkpoint's variable list.
"""

import contextlib
import re

from framework import _tf_internal
from framework.model_parallel.parallel_layers import CheckpointNode

UNSPLIT = "unsplit"  # saved by `unsplit_view`: any mesh resumes it
SPLIT = "split"      # saved by the split optimizer itself (older distloop)

_VARIABLE_LIST = re.compile(
    r"optimizer/_trainable_variables/(\d+)/\.ATTRIBUTES/VARIABLE_VALUE")


def saved_shapes(reader):
  """[shape] of the checkpoint's `optimizer/_trainable_variables`, by index
  ([] if it has none); `reader`: `tf.train.load_checkpoint(path)`."""
  shapes = {}
  for key, shape in reader.get_variable_to_shape_map().items():
    match = _VARIABLE_LIST.fullmatch(key)
    if match:
      shapes[int(match.group(1))] = tuple(shape)
  return [shapes[i] for i in sorted(shapes)]


class OptimizerLayout(CheckpointNode):
  """`optimizer` in a transformer split's checkpoints (see the module).

  Args:
    view: `unsplit_view(optimizer, ...)`.
    optimizer: the split's built optimizer.
    unsplit_variables: the unsplit model's trainable variables.
  """

  def __init__(self, view, optimizer, unsplit_variables):
    self.view = view
    self.optimizer = optimizer
    self.unsplit_shapes = [tuple(v.shape) for v in unsplit_variables]
    self.split_shapes = [
        tuple(v.shape) for v in
        _tf_internal.trackable_children(optimizer)["_trainable_variables"]]
    self._split = False

  def layout_of(self, reader, *, written_as_split=False):
    """UNSPLIT, SPLIT (this split's own layout) or None (neither: another
    split's own layout, or another model). Where both layouts have the
    same shapes (one shard), SPLIT iff `written_as_split` (the checkpoint's
    run_config records the split model's fingerprint)."""
    shapes = saved_shapes(reader)
    if shapes == self.split_shapes and (
        written_as_split or shapes != self.unsplit_shapes):
      return SPLIT
    if shapes == self.unsplit_shapes:
      return UNSPLIT
    return None

  @contextlib.contextmanager
  def restoring_split(self):
    """Within: checkpoints see the split optimizer's own object graph."""
    self._split = True
    try:
      yield self
    finally:
      self._split = False

  def _trackable_children(self, save_type="checkpoint", **kwargs):
    target = self.optimizer if self._split else self.view
    return target._trackable_children(save_type, **kwargs)  # pylint: disable=protected-access
