"""Data x pipeline: R copies of an S-stage pipeline on R*S devices.

    --strategy=mirrored --cpu_devices=4 --num_stages=2:
      devices   /CPU:0 /CPU:1 | /CPU:2 /CPU:3
      copy r=0  stage 0 stage 1                 (the model: checkpointed)
      copy r=1                   stage 0 stage 1 (kept equal to copy 0)

The data-parallel strategy only says which devices there are: its R*S
devices are cut into R groups of S consecutive devices, copy r of the
pipeline runs on group r with the r-th consecutive share of the global
batch, and the run itself uses one replica (the default strategy). Each
stage's gradients are summed across its R copies by TensorFlow's
collective all-reduce (`all_reduce_copies`: one CollectiveReduceV2 per copy,
on its device) and every copy applies the same update.
"""

import tensorflow as tf

# TensorFlow's collective all-reduce as a cross-device op (what
# MultiWorkerMirroredStrategy uses; not exported under tf.distribute), its
# keys, and PerReplica, the input type of tf.distribute's cross-device ops.
from framework import _tf_internal
from framework.errors import ConfigError
from framework.model_parallel.devices import short_device

SUM = tf.distribute.ReduceOp.SUM


def replica_groups(devices, num_stages, *, strategy="mirrored",
                   name="num_stages"):
  """`devices` (R*S of them) cut into R lists of S consecutive devices.

  Args:
    name: the argument S came from (`num_shards` for data x tensor).
  Raises:
    ConfigError: the device count is not a multiple of `num_stages`.
  """
  devices = [short_device(d) for d in devices]
  split = "pipeline" if name == "num_stages" else "tensor"
  if len(devices) % num_stages:
    raise ConfigError(
        f"strategy={strategy} has {len(devices)} devices, not a multiple of "
        f"{name}={num_stages}: data x {split} needs R * {name} "
        f"devices (e.g. --cpu_devices={2 * num_stages} for 2 copies)")
  return [devices[r:r + num_stages]
          for r in range(0, len(devices), num_stages)]


def split_strategy(strategy, num_stages, *, name="mirrored",
                   argument="num_stages"):
  """(one-replica strategy, R device groups) for a pipeline under `strategy`.

  A one-replica strategy is returned as it is, with no groups (None): the
  plain pipeline. A local multi-replica strategy (mirrored) gives its
  devices to `replica_groups`; the run then uses the default strategy.

  Raises:
    ConfigError: a cluster strategy, or a bad device count.
  """
  if strategy.num_replicas_in_sync == 1:
    return strategy, None
  if not isinstance(strategy, tf.distribute.MirroredStrategy):
    split = "pipeline" if argument == "num_stages" else "tensor"
    raise ConfigError(
        f"model_parallel={split} with strategy={name} is not supported; "
        f"use strategy=mirrored (R copies of the split on R * {argument} "
        "local devices) or strategy=default")
  groups = replica_groups(strategy.extended.worker_devices, num_stages,
                          strategy=name, name=argument)
  return tf.distribute.get_strategy(), groups


def _pack(tensors):
  return tf.concat([tf.reshape(t, [-1]) for t in tensors], 0)


def _unpack(vector, like):
  sizes = [t.shape.num_elements() for t in like]  # variables' shapes
  return [tf.reshape(part, tf.shape(t))
          for part, t in zip(tf.split(vector, sizes), like)]


# One set of keys per process: each stage's group of devices gets its own
# group key, each all-reduce its own instance key.
_COLLECTIVE_KEYS = _tf_internal.collective_keys()
_COLLECTIVES = {}


def collective_all_reduce(devices):
  """TensorFlow's collective all-reduce over `devices` (one per group)."""
  key = tuple(devices)
  if key not in _COLLECTIVES:
    _COLLECTIVES[key] = _tf_internal.collective_all_reduce(
        devices, _COLLECTIVE_KEYS)
  return _COLLECTIVES[key]


def all_reduce_copies(per_copy, devices):
  """The sum over copies of one stage's gradients, on every copy's device.

  Args:
    per_copy: R lists of gradients (copy r's on `devices[r]`), same shapes.
    devices: the R devices of this stage's copies.
  Returns:
    R lists: the summed gradients, list r on `devices[r]` (equal values).
  """
  if len(per_copy) == 1:
    return [list(per_copy[0])]
  # One reduction per stage: each copy packs its gradients into a vector.
  vectors = []
  for grads, device in zip(per_copy, devices):
    with tf.device(device), tf.name_scope("pack_gradients/"):
      vectors.append(_pack(grads))
  # One CollectiveReduceV2 per copy, on its device, all in one group.
  # (Raw collective ops without the launcher's ordering tokens hang between
  # logical CPU devices of one process in TF 2.21; through
  # CollectiveAllReduce they complete.)
  summed = collective_all_reduce(devices).reduce(
      SUM, _tf_internal.per_replica(vectors),
      destinations=_tf_internal.per_replica(vectors))
  results = []
  for vector, device, grads in zip(summed.values, devices, per_copy):
    with tf.device(device), tf.name_scope("unpack_gradients/"):
      results.append(_unpack(vector, grads))
  return results
