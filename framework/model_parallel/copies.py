"""Data x pipeline (x tensor): R copies of a split, one per group of devices.

    --strategy=mirrored --cpu_devices=4 --num_stages=2:
      devices   /CPU:0 /CPU:1 | /CPU:2 /CPU:3
      copy r=0  stage 0 stage 1                 (the model: checkpointed)
      copy r=1                   stage 0 stage 1 (kept equal to copy 0)

The data-parallel strategy only says which devices there are: its R*S
devices are cut into R groups of S consecutive devices (`split_strategy`,
`replica_groups`; a `--mesh` cuts them itself), copy r of the split runs on
group r with the r-th consecutive share of the global batch, and the run
itself uses one replica (the default strategy). Each stage's gradients are
summed across its R copies by TensorFlow's collective all-reduce
(`all_reduce_copies`: one CollectiveReduceV2 per copy, on its device, over
the data axis only) and every copy applies the same update, so the copies
stay equal. Copy 0 is the model that checkpoints, summaries and the weights
file see; the others follow it after a restore
(`PipelineCopies.sync_copies`). With `shard_optimizer_state`, copy r keeps
and updates 1/R of every optimizer slot (`optimizer_sharding`, ZeRO-1 on the
data axis).
"""

import keras
import tensorflow as tf

from framework import _tf_internal
from framework.errors import ConfigError
from framework.model_parallel.devices import short_device


SUM = tf.distribute.ReduceOp.SUM


def replica_groups(devices, num_stages, *, strategy_name="mirrored",
                   name="num_stages"):
  """`devices` (R*S of them) cut into R lists of S consecutive devices.

  Args:
    strategy_name: the strategy the devices are of, for messages.
    name: the argument S came from (`num_shards` for data x tensor).
  Raises:
    ConfigError: the device count is not a multiple of `num_stages`.
  """
  devices = [short_device(d) for d in devices]
  split = "pipeline" if name == "num_stages" else "tensor"
  if len(devices) % num_stages:
    raise ConfigError(
        f"strategy={strategy_name} has {len(devices)} devices, not a "
        f"multiple of {name}={num_stages}: data x {split} needs R * {name} "
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
                          strategy_name=name, name=argument)
  return tf.distribute.get_strategy(), groups


def _pack(tensors):
  return tf.concat([tf.reshape(t, [-1]) for t in tensors], 0)


def _unpack(vector, like):
  sizes = [t.shape.num_elements() for t in like]  # variables' shapes
  return [tf.reshape(part, tf.shape(t))
          for part, t in zip(tf.split(vector, sizes), like)]


# TensorFlow's collective all-reduce as a cross-device op (what
# MultiWorkerMirroredStrategy uses; not exported under tf.distribute) and its
# keys, one set per process: each stage's group of devices gets its own
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


def tf_variable(variable):
  """The tf.Variable behind a Keras variable (a tf.Variable as it is)."""
  return variable.value if isinstance(variable, keras.Variable) else variable


class PipelineCopies:
  """The copies' half of `StagedTrainer` (a mixin: it reads the trainer's
  `stages`, `variables`, `optimizer` and `_pipeline_gradients`).

  Attributes:
    copies: `(stages, model, optimizer)` of copies 1..R-1 (empty: one copy).
  """

  def _set_up_copies(self, copies):
    """Builds the copies' optimizers, which share copy 0's step counter."""
    self.copies = copies
    self._copy_optimizers = {}
    self._sync_copies_fn = None
    for stages, model, optimizer in copies:
      variables = [v for s in stages for v in s.trainable_variables]
      if len(variables) != len(self.variables) or any(
          a.shape != b.shape for a, b in zip(variables, self.variables)):
        raise ValueError("a pipeline copy must have the stages' variables")
      if self.copy_sharding is not None:
        continue  # built on their shards, one step counter
      # One step counter: Adam's bias correction and any learning-rate
      # schedule see the same step in every copy.
      _tf_internal.share_step_counter(optimizer, self.optimizer.iterations)
      with self.strategy.scope():
        optimizer.build(model.trainable_variables)
      for v in variables:
        self._copy_optimizers[id(tf_variable(v))] = optimizer
    if self.copy_sharding is not None:
      self._copy_optimizers = self.copy_sharding.optimizer_of()

  def _copies_train_step(self, features, labels):
    per_copy, loss, accuracy = self._copies_gradients(features, labels)
    # Every copy holds the same summed gradient: one norm, one clip.
    grads, grad_norm = self.clip_by_global_norm(per_copy[0])
    all_grads, variables = list(grads), list(self.variables)
    for (stages, _, _), copy_grads in zip(self.copies, per_copy[1:]):
      if self.clip_norm is not None:
        copy_grads, _ = tf.clip_by_global_norm(copy_grads, self.clip_norm,
                                               use_norm=grad_norm)
      all_grads.extend(copy_grads)
      variables.extend(v for s in stages for v in s.trainable_variables)
    if self.copy_sharding is not None:
      self._apply_copy_shards(all_grads, variables)
    else:
      # One optimizer step: each copy's variables updated on their device.
      self.apply_gradients(all_grads, variables)
    return {"loss": loss, "accuracy": accuracy,
            "grad_norm": self.replica_share(grad_norm)}

  def _apply_copy_shards(self, grads, variables):
    """One step with the optimizer state sharded over the copies: the
    trainer's `updates.CopyShardedUpdate` (copy r updates slice r of each
    of its variables, then every copy's variables are joined from all
    copies' slices)."""
    return self.updater.apply(grads, variables)

  def _copy_pairs(self):
    """(copy 0's variable, copy r's variable): weights, optimizer slots."""
    # The slots. The step counter is shared and the learning rate copy 0's
    # (a copy's own are unused).
    own = _tf_internal.optimizer_slot_variables
    pairs = []
    for _, model, optimizer in self.copies:
      pairs += zip(self.model.weights, model.weights)
      if self.copy_sharding is None:  # sharded: each copy its own slice
        pairs += zip(own(self.optimizer), own(optimizer))
    for a, b in pairs:
      if a.shape != b.shape:
        raise ValueError(f"pipeline copy mismatch: {a.path} {a.shape}, "
                         f"{b.path} {b.shape}")
    return pairs

  def sync_copies(self):
    """Sets every copy's weights and optimizer slots to copy 0's.

    Copy 0 is what checkpoints save and restore (and what the weights file
    holds); the copies follow it after a restore. Equal copies stay equal:
    they apply the same update every step. With the state sharded over the
    copies only the weights: each copy's slots are its own slice, which a
    restore sets directly (`optimizer_sharding`).
    """
    if self._sync_copies_fn is None:
      pairs = self._copy_pairs()

      def sync():
        for source, target in pairs:
          target.assign(source)

      self._sync_copies_fn = tf.function(sync)
    self._sync_copies_fn()

  def _copies_gradients(self, features, labels):
    """(R lists of gradients, loss, accuracy): every copy's gradients.

    Copy r runs the pipeline on the r-th consecutive share of the batch;
    its micro-batch losses are still divided by the GLOBAL batch size, so
    the sum over copies of a stage's gradients is the full-batch gradient.
    """
    all_stages = [self.stages] + [stages for stages, _, _ in self.copies]
    per_copy, losses, accuracies = [], [], []
    for stages, x, y in zip(all_stages, tf.split(features, len(all_stages)),
                            tf.split(labels, len(all_stages))):
      grads, loss, accuracy = self._pipeline_gradients(stages, x, y)
      per_copy.append(grads)
      losses.append(loss)
      accuracies.append(accuracy)
    # Stage i's gradients, all-reduced across the R copies of stage i.
    reduced = [[] for _ in all_stages]
    for i in range(len(self.stages)):
      summed = all_reduce_copies([grads[i] for grads in per_copy],
                                 [stages[i].device for stages in all_stages])
      for r, stage_grads in enumerate(summed):
        reduced[r].extend(stage_grads)
    with tf.device(self.stages[-1].device):
      return reduced, tf.add_n(losses), tf.add_n(accuracies)
