"""Loss spikes: the running median a step is judged against, and rollback.

Under `spike_policy=skip` or `rollback` (`Trainer`), each step's global
loss (the SUM of the replicas' shares: equal on every replica) and its
gradient norm before clipping (of the all-reduced gradient) are compared,
in the step's graph, with the median of the last `spike_window` finite
steps' values:

    spike = window full and (loss > factor * median(losses)
                             or norm > factor * median(norms))

Every finite step, spike or not, enters the window (a median ignores a
lone spike, and a loss that settles higher is soon the new median). No
spike is decided before the window is full. The window is in the
checkpoint, so a resumed run decides as an uninterrupted one would.

- skip: the spike's update is dropped like a non-finite one under
  `nan_policy=skip` (weights, optimizer slots and iterations, EMA
  unchanged), counted in `spikes/skipped`.
- rollback: the update is dropped, the loop ends at that step and the
  Controller restores the last checkpoint (step c) and skips the batches
  of steps c+1 .. spike (their batch indices: `RollbackRecord`, written to
  `model_dir/spike_batches.json`, which a relaunch reads). The steps c+1 ..
  spike are then trained again on the batches after them; their count goes
  to `spikes/rolled_back`. Before the first checkpoint a spike is skipped.

Batch indices count the batches of `train_input(0)` (batch i is what step
i + 1 of a run with no skipped batches trains on).
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterable, Sequence

import tensorflow as tf

from framework.core.checkpoints import run_files
from framework.errors import CheckpointError

# The run folder's record of the batches rollbacks skipped.
BATCHES_FILE = "spike_batches.json"


def median(values: tf.Tensor) -> tf.Tensor:
  """The median of a 1-D tensor (the mean of the middle two if even)."""
  ordered = tf.sort(values)
  n = values.shape[0]
  return (ordered[(n - 1) // 2] + ordered[n // 2]) / 2


class SpikeWindow(tf.Module):
  """The last `window` finite steps' losses and gradient norms and the
  spike counts (all checkpointed); create it under `strategy.scope()`.

  Its methods run in cross-replica context (inside the update's
  merge_call), on values equal on every replica.
  """

  def __init__(self, factor: float, window: int, policy: str):
    super().__init__(name="spike_window")
    self.factor = float(factor)
    self.window = int(window)
    self.policy = policy
    kind = dict(trainable=False,
                aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
    self.losses = tf.Variable(tf.zeros([window]), name="losses", **kind)
    self.norms = tf.Variable(tf.zeros([window]), name="norms", **kind)
    # Finite steps seen so far (the next slot is seen % window).
    self.seen = tf.Variable(0, dtype=tf.int64, name="seen", **kind)
    self.skipped = tf.Variable(0, dtype=tf.int64, name="skipped", **kind)
    # The global step of a spike awaiting its rollback (0: none); not a
    # run total, so never restored as one (the Controller clears it).
    self.pending = tf.Variable(0, dtype=tf.int64, name="pending", **kind)

  def is_spike(self, loss: tf.Tensor, norm: tf.Tensor) -> tf.Tensor:
    """Whether (`loss`, `norm`) is a spike against the window."""
    full = self.seen >= self.window
    above = tf.logical_or(
        loss > self.factor * median(self.losses.read_value()),
        norm > self.factor * median(self.norms.read_value()))
    return tf.logical_and(full, above)

  def push(self, loss: tf.Tensor, norm: tf.Tensor) -> tf.Tensor:
    """Puts a finite step's values into the window (returns True)."""
    slot = tf.cast(self.seen % self.window, tf.int32)[None, None]
    # assign, not scatter_nd_update: a mirrored variable has only assign.
    with tf.control_dependencies([
        v.assign(tf.tensor_scatter_nd_update(
            v.read_value(), slot, tf.reshape(value, [1])))
        for v, value in ((self.losses, loss), (self.norms, norm))]):
      with tf.control_dependencies([self.seen.assign_add(1)]):
        return tf.constant(True)

  def take_pending(self) -> int:
    """The step of a spike awaiting rollback (0: none), cleared."""
    step = int(self.pending.numpy())
    if step:
      self.pending.assign(0)
    return step


# Which batch each step trains on when rollbacks skipped some.
def data_position(step: int, skipped: Sequence[int]) -> int:
  """The batch index step `step + 1` trains on: the `step`-th (from 0)
  batch index not in `skipped` (sorted)."""
  position = step
  for index in skipped:
    if index <= position:
      position += 1
    else:
      break
  return position


def skip_batches(data: Any, start: int, skipped: Sequence[int]) -> Any:
  """`data` (batches from index `start` on) without the batches `skipped`
  names (unchanged when none is at or after `start`)."""
  ahead = [i for i in skipped if i >= start]
  if not ahead:
    return data
  if not isinstance(data, tf.data.Dataset):
    raise CheckpointError(
        f"spike_policy=rollback: train_input gives {type(data).__name__}, "
        "not a tf.data.Dataset, so the batches a rollback skipped cannot be "
        "left out; give a plain tf.data.Dataset")
  ahead = tf.constant(ahead, tf.int64)
  return data.enumerate(start).filter(
      lambda i, _: tf.logical_not(tf.reduce_any(tf.equal(i, ahead)))).map(
          lambda _, batch: batch)


def _index(value) -> bool:
  """Whether `value` is a step or batch index (an int64 tensor holds it)."""
  return (isinstance(value, int) and not isinstance(value, bool)
          and 0 <= value < 2**62)


class RollbackRecord:
  """`model_dir/spike_batches.json`: each rollback (the spike's step, the
  checkpoint's step, the batch indices skipped), read as plain data."""

  def __init__(self, model_dir: str):
    self.path = os.path.join(model_dir, BATCHES_FILE)
    self.rollbacks = self._read()

  def _read(self):
    try:
      # read_json refuses a FIFO, a device, a huge file, a directory.
      record = run_files.read_json(self.path, object_only=True)
      if record is None:
        return []
      rollbacks = record["rollbacks"]
      for r in rollbacks:
        if not (_index(r["checkpoint_step"]) and _index(r["spike_step"])
                and r["checkpoint_step"] <= r["spike_step"]
                and all(_index(i) for i in r["batches"])):
          raise ValueError("not step and batch indices from 0 to 2**62, "
                           "checkpoint_step <= spike_step")
    except (ValueError, KeyError, TypeError, tf.errors.OpError,
            CheckpointError) as e:
      raise CheckpointError(
          f"{self.path} is not a spike_batches record "
          f"({(str(e).splitlines() or [type(e).__name__])[0]}); restore or "
          "remove it (its batches are then trained on again)") from None
    return rollbacks

  @property
  def skipped(self) -> list[int]:
    """Every batch index skipped, sorted."""
    return sorted({i for r in self.rollbacks for i in r["batches"]})

  @property
  def rolled_back_steps(self) -> int:
    """Steps undone by the rollbacks, in total."""
    return sum(r["spike_step"] - r["checkpoint_step"] for r in self.rollbacks)

  def add(self, spike_step: int, checkpoint_step: int, write: bool) -> list:
    """Records a rollback from `spike_step` to `checkpoint_step` (written
    when `write`: the chief); returns the batch indices it skips."""
    before = self.skipped
    batches = [data_position(step, before)
               for step in range(checkpoint_step, spike_step)]
    self.rollbacks.append(dict(spike_step=spike_step,
                               checkpoint_step=checkpoint_step,
                               batches=batches))
    if write:
      text = json.dumps({"rollbacks": self.rollbacks}, indent=1)
      run_files.write_atomically(self.path, lambda tmp: _write(tmp, text))
    return batches


def _write(path: str, text: str) -> None:
  with tf.io.gfile.GFile(path, "w") as f:
    f.write(text)


def batches_text(batches: Iterable[int]) -> str:
  """`12..15` for a run of indices, else the list."""
  batches = list(batches)
  if batches and batches == list(range(batches[0], batches[-1] + 1)):
    return f"{batches[0]}..{batches[-1]}" if len(batches) > 1 else str(
        batches[0])
  return ",".join(map(str, batches))
