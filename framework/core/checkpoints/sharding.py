"""Who writes a checkpoint's tensors: the chief (`gathered`) or each task.

TensorFlow's saver groups the tensors a checkpoint serializes by the task
of their device and writes each group from that task, one data file per
task (`tf.train.experimental.ShardByTaskPolicy`, also its default), into
`<prefix>_temp/`, then merges the index on one task and renames the files
into place (`ckpt-N.index`, `ckpt-N.data-0000i-of-0000n`). Which task
writes a tensor is therefore decided by where the tensor is when it is
serialized:

- `gathered` (the default): a weight cut over several devices
  (`framework.model_parallel.parallel_layers.ShardedWeight`) is joined on
  the chief's CPU and written by the chief, whole: with a model split
  across processes, the chief receives every cut weight and its slots.
- `by_task`: each piece is written from its own device as a slice of the
  whole tensor (the same checkpoint key, a slice spec per piece), so each
  task writes the pieces it holds and no process receives the others'.

Both give the same keys and shapes: the checkpoint bundle reads a whole
tensor out of slices, so any layout (one device, a mesh in one process or
across processes, either sharding) restores a checkpoint of any other. A
restore reads each split weight whole on the chief and sends each device
its piece, under either sharding: TensorFlow's restore of an object's
sliced tensors (`TrackableSaveable.restore`, TF 2.21) hands the object
only the first slice, so only the writes are per task. `by_task` matters only where one
program's variables live on several tasks (`--model_parallel_devices=
cluster`); under a data-parallel strategy each process holds and writes
its own whole copy, and under `parameter_server` the variables already
live on the ps tasks.

The files of every task land in `model_dir` (the tasks share its
filesystem); the chief publishes the checkpoint as before (the state file
after the merged index), and `manager.damage` reads every data file the
index names, so `latest_intact` covers each task's file.
"""

import contextlib
import contextvars

import tensorflow as tf

from framework.core.config import CHECKPOINT_SHARDINGS
from framework.errors import check_choice

_ACTIVE = contextvars.ContextVar("checkpoint_sharding", default="gathered")


def options(sharding):
  """The `tf.train.CheckpointOptions` a save of `sharding` uses."""
  check_choice("checkpoint_sharding", sharding, CHECKPOINT_SHARDINGS)
  if sharding == "by_task":
    # TensorFlow's default policy too; named so that a change of the
    # default does not change what by_task writes.
    return tf.train.CheckpointOptions(
        experimental_sharding_callback=(
            tf.train.experimental.ShardByTaskPolicy()))
  return tf.train.CheckpointOptions()


@contextlib.contextmanager
def active(sharding):
  """Serialize the checkpoint's split weights for a save of `sharding`
  inside the block (`by_task()` reads it)."""
  check_choice("checkpoint_sharding", sharding, CHECKPOINT_SHARDINGS)
  token = _ACTIVE.set(sharding)
  try:
    yield
  finally:
    _ACTIVE.reset(token)


def by_task():
  """Whether the save under way writes each piece from its own device
  (`active("by_task")`)."""
  return _ACTIVE.get() == "by_task"
