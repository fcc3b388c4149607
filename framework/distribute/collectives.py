"""A reduce-scatter over a strategy's replicas, on CPU and across processes.

TensorFlow's reduce-scatter collective has an implementation on GPUs only
(NCCL); on CPU its kernel fails with "CollectiveRegistry::Lookup did not
find collective implementation". The all-to-all collective runs everywhere,
so a reduce-scatter is an all-to-all followed by a local sum:

    chunks = reshape(x, [N, L])     # chunk i is replica i's part of the sum
    rows = all_to_all(chunks)       # row j: replica j's chunk for this one
    shard = reduce_sum(rows, 0)     # this replica's [L] of the SUM

Each device sends N-1 chunks of L elements and receives as many: (N-1)/N of
the tensor, what a ring reduce-scatter moves, half of a ring all-reduce's
2(N-1)/N. For N=2 the sum is `a + b` on both sides, as an all-reduce's.
"""

from __future__ import annotations

import tensorflow as tf

from framework import _tf_internal

# One set of keys per process: every ReduceScatter of the same devices gets
# the same group, and instance keys never repeat within it (the runtime
# remembers each (group, instance)'s shape). Far above the group keys of
# the strategies (from 1) and of the model-parallel all-reduces (1e6).
_KEYS = None


def _keys():
  global _KEYS
  if _KEYS is None:
    _KEYS = _tf_internal.collective_keys(group_key_start=2_000_000)
  return _KEYS


class ReduceScatter:
  """SUM over the replicas of `strategy` of equal-shaped tensors, each
  replica receiving only its slice (replica r: row r of `[N, L]`).

  Args:
    strategy: a MirroredStrategy or MultiWorkerMirroredStrategy (its
      replicas call `__call__` in replica context, as collectives do:
      all of them, in the same order).
  """

  def __init__(self, strategy):
    self.num_replicas = strategy.num_replicas_in_sync
    self._devices = tuple(strategy.extended.worker_devices)
    self._launchers = _tf_internal.collective_launcher(
        self._devices, self.num_replicas, _keys())

  def __call__(self, chunks):
    """Row `replica_id` of the SUM over replicas of `chunks` ([N, L] on
    every replica, one tensor or a list of them with the same dtype; a
    list goes out as one all-to-all)."""
    context = tf.distribute.get_replica_context()
    values = chunks if isinstance(chunks, (list, tuple)) else [chunks]
    # Replica ids are worker-major (MultiWorkerMirroredStrategy: worker w's
    # local replica i is w * local + i); `context.devices` fails on a
    # worker other than the first.
    replica = int(tf.get_static_value(context.replica_id_in_sync_group))
    launcher = self._launchers[self._devices[replica % len(self._devices)]]
    widths = [v.shape[1] for v in values]
    packed = tf.concat(values, axis=1) if len(values) > 1 else values[0]
    rows = _tf_internal.all_to_all(launcher, packed)
    summed = tf.reduce_sum(rows, axis=0)
    if not isinstance(chunks, (list, tuple)):
      return summed
    return tf.split(summed, widths) if len(values) > 1 else [summed]
