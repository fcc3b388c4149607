"""Optimizer-state sharding (ZeRO-1): each replica keeps 1/N of the slots.

Data parallelism keeps a full copy of the optimizer state on every replica
(Adam: two slots, 2x the parameters). With `shard_optimizer_state` the
trainer splits every trainable variable, flattened and zero-padded to a
multiple of N, into N equal shards; replica r owns shard r:

    grads = all_reduce(grads); clip_by_global_norm(grads)  # full, unchanged
    g_r   = flat(grad)[r*L:(r+1)*L]       # this replica's slice
    w_r   = flat(weight)[r*L:(r+1)*L]     # into a [L] shard variable
    update_step(g_r, w_r)                 # slots of shape [L]: 1/N each
    weight = all_gather(w_r)[:n]          # ReplicaContext.all_gather

The optimizer is built on the shard variables, so Keras's own `update_step`
(or the fused kernel) does the update and its slots are [L]-shaped
per-device copies, each holding its own replica's shard. Elementwise
optimizers only (SGD, momentum, Adam, AdamW): a shard's update must not
need the rest of the variable. The gradient is all-reduced whole, so
clipping by global norm sees the full gradient; the cost is one all-gather
of the weights per step.

Checkpoints hold the full slots under the keys an unsharded run writes
(`checkpointed_optimizer`: the optimizer's own object graph with each slot
gathered at save and re-sliced at restore), so a run resumes with sharding
on or off and with another replica count.
"""

from __future__ import annotations

import math

import keras
import tensorflow as tf

from framework import _tf_internal
from framework.errors import ConfigError

# Exact classes: a subclass may have changed `update_step`.
SHARDABLE_OPTIMIZERS = (keras.optimizers.SGD, keras.optimizers.Adam,
                        keras.optimizers.AdamW)
STRATEGIES = (tf.distribute.MirroredStrategy,
              tf.distribute.MultiWorkerMirroredStrategy)


def check_elementwise(optimizer):
  """ConfigError unless `optimizer`'s update is elementwise (a shard's
  update needs no other part of the variable)."""
  if type(optimizer) not in SHARDABLE_OPTIMIZERS:
    names = ", ".join(c.__name__ for c in SHARDABLE_OPTIMIZERS)
    raise ConfigError(
        f"shard_optimizer_state=True: optimizer {type(optimizer).__name__} "
        f"is not one whose update is elementwise ({names}); turn "
        "shard_optimizer_state off")


def check_shardable(optimizer, strategy):
  """ConfigError unless `optimizer` and `strategy` can shard the state."""
  check_elementwise(optimizer)
  if not isinstance(strategy, STRATEGIES):
    raise ConfigError(
        f"shard_optimizer_state=True needs a strategy whose replicas each "
        f"hold the variables (mirrored, multi_worker_mirrored), not "
        f"{type(strategy).__name__}")


def shard_length(variable, num_shards):
  """Elements of each of `variable`'s `num_shards` shards (padded)."""
  return max(1, math.ceil(tf.TensorShape(variable.shape).num_elements() /
                          num_shards))


def padded(value, length, num_shards):
  """`value` flattened, zero-padded to `num_shards * length` elements (a
  padded copy only where the size is not a multiple already)."""
  flat = tf.reshape(tf.convert_to_tensor(value), [-1])
  padding = length * num_shards - flat.shape[0]
  return tf.pad(flat, [[0, padding]]) if padding else flat


def shard_of(value, length, num_shards, index):
  """Shard `index` ([length]) of the full tensor `value`."""
  return tf.reshape(padded(value, length, num_shards),
                    [num_shards, length])[index]


def unshard(flat, variable):
  """The first elements of `flat` (shards joined) in `variable`'s shape."""
  n = tf.TensorShape(variable.shape).num_elements()
  return tf.reshape(flat[:n], variable.shape)


def _is_variable(value):
  return isinstance(value, (keras.Variable, tf.Variable))


def _is_list(value):
  """A list the optimizer tracks (Keras wraps lists for checkpoints)."""
  return (not _is_variable(value) and not hasattr(value, "keys") and
          hasattr(value, "__iter__") and hasattr(value, "__len__"))


def _local(value):
  """The tf.Variable behind a Keras variable."""
  return getattr(value, "value", value)


def checked_slot(value, slot, variable):
  """`value`, a full slot from a checkpoint, as a tensor of `variable`'s
  shape (ValueError if it has another)."""
  value = tf.convert_to_tensor(value)
  if value.shape != variable.shape:
    raise ValueError(f"slot {slot.path}: checkpoint shape {value.shape} "
                     f"!= variable shape {variable.shape}")
  return value


def slot_parameters(optimizer, num_variables):
  """[(slot, parameter index)] of every variable of `optimizer` (built on
  `num_variables` variables) but the step and the learning rate. Keras
  keeps each kind of slot as a list aligned with the variables it was
  built on."""
  by_id = {}
  for name, child in _tf_internal.trackable_children(optimizer).items():
    if name in ("_variables", "_trainable_variables"):
      continue
    if _is_list(child):
      items = list(child)
      if len(items) == num_variables:
        for index, slot in enumerate(items):
          by_id[id(slot)] = (slot, index)
  own = {id(optimizer.iterations)}
  rate = _tf_internal.learning_rate_variable(optimizer)
  if rate is not None:
    own.add(id(rate))
  slots = []
  # By name too: an optimizer counting its steps in another's counter
  # (a mesh copy's) still holds its own unused one.
  for variable in _tf_internal.optimizer_slot_variables(optimizer):
    if id(variable) in own:
      continue
    if id(variable) not in by_id:
      raise ConfigError(
          f"shard_optimizer_state=True: {type(optimizer).__name__} "
          f"variable {variable.path} is not a per-variable slot; turn "
          "shard_optimizer_state off")
    slots.append(by_id[id(variable)])
  return slots


def saved_slots(slots, save, restore, variables):
  """{id(slot): checkpoint node} for each of `slots` ([(slot, index)]):
  node p saves `save(p)`, the full slot (of `variables[index]`'s shape),
  and restores via `restore(p, value)`, under the slot's key."""
  return {id(slot): _tf_internal.SavedAsVariable(
      save=lambda p=position: save(p),
      restore=lambda value, p=position: restore(p, value),
      shape=tuple(variables[index].shape))
          for position, (slot, index) in enumerate(slots)}


def checkpoint_view(optimizer, replaced):
  """`optimizer`'s checkpoint graph with each object whose id is a key of
  `replaced` saved as its value instead (a shard: the model's variable; a
  slot: a `SavedAsVariable` of the full slot): what an unsharded run's
  optimizer writes, under the same keys."""

  def convert(child):
    if id(child) in replaced:
      return replaced[id(child)]
    if _is_variable(child):
      return child
    if hasattr(child, "keys"):  # Keras's dict of variable indices
      return {k: convert(v) for k, v in child.items()}
    if _is_list(child):
      return [convert(v) for v in child]
    return child

  view = tf.Module(name="sharded_optimizer")
  for name, child in _tf_internal.trackable_children(optimizer).items():
    setattr(view, name, convert(child))
  return view


class ShardedOptimizerState:
  """The shard variables, the optimizer built on them, and its checkpoint.

  Args:
    optimizer: an unbuilt Keras optimizer (SGD, Adam, AdamW) created in
      `strategy.scope()`; built here on the shards.
    strategy: a MirroredStrategy or MultiWorkerMirroredStrategy.
    variables: the model's trainable variables.
  """

  def __init__(self, optimizer, strategy, variables):
    check_shardable(optimizer, strategy)
    self.optimizer = optimizer
    self.strategy = strategy
    self.variables = list(variables)
    self.num_shards = strategy.num_replicas_in_sync
    with strategy.scope():
      # Mirrored variables whose per-device copies diverge: copy r holds
      # shard r. Only `strategy.extended.update` and replica-local reads
      # touch them, never a cross-replica read.
      self.shards = [
          keras.Variable(tf.zeros([shard_length(v, self.num_shards)],
                                  v.dtype), trainable=False,
                         name=f"{v.name}_shard")
          for v in self.variables]
      optimizer.build(self.shards)
    self._replica_ids = self._local_replica_ids()
    self._slots = slot_parameters(optimizer, len(self.shards))
    self._gather_slots = tf.function(self._gather_slots_fn)
    self._gathered = None  # (iterations, [full slot]) of the last save
    self.checkpointed_optimizer = checkpoint_view(optimizer, {
        **{id(s): v for s, v in zip(self.shards, self.variables)},
        **saved_slots(self._slots, self._full_slot, self._restore_slot,
                      self.variables)})

  # --- The step (called by GradientPipeline). --------------------------------

  def local_shards(self, values, replica_id):
    """This replica's [L] slice of each full tensor in `values`."""
    return [shard_of(value, shard.shape[0], self.num_shards, replica_id)
            for value, shard in zip(values, self.shards)]

  def gather_weights(self, context):
    """The full weights from every replica's updated shard (replica
    context): one all-gather of all shards."""
    gathered = context.all_gather(self._read_local(self.shards), axis=0)
    return [unshard(g, v) for g, v in zip(gathered, self.variables)]

  def _read_local(self, variables):
    """This replica's copies of `variables` as tensors placed on its device
    (a gather's destination is the device of what it gathers; a worker
    with one device runs its replica outside any device scope)."""
    devices = self.strategy.extended.worker_devices
    if len(devices) == 1:
      with tf.device(devices[0]):
        return [tf.identity(_local(v)) for v in variables]
    return [tf.convert_to_tensor(_local(v)) for v in variables]

  # --- Memory (what each device holds). ----------------------------------

  def slot_variables(self):
    """The optimizer's per-parameter slots (all [L]-shaped)."""
    return [slot for slot, _ in self._slots]

  # --- Checkpoints: full slots under the unsharded run's keys. ---------------

  def _local_replica_ids(self):
    """The global replica id of each local copy, in copy order."""
    ids = self.strategy.run(tf.function(
        lambda: tf.distribute.get_replica_context().replica_id_in_sync_group))
    return [int(i) for i in self.strategy.experimental_local_results(ids)]

  def _gather_slots_fn(self):
    def gather():
      context = tf.distribute.get_replica_context()
      return context.all_gather(
          self._read_local([s for s, _ in self._slots]), axis=0)
    gathered = self.strategy.run(gather)
    return [self.strategy.experimental_local_results(g)[0] for g in gathered]

  def _full_slot(self, position):
    """Slot `position` gathered whole, in its parameter's shape. All slots
    are gathered at once and kept until the optimizer steps again (every
    worker saves the same objects in the same order)."""
    step = int(self.optimizer.iterations.numpy())
    if self._gathered is None or self._gathered[0] != step:
      self._gathered = (step, self._gather_slots())
    _, index = self._slots[position]
    return unshard(self._gathered[1][position], self.variables[index])

  def _restore_slot(self, position, value):
    """Slices a full slot (from a sharded or unsharded run, any replica
    count) into this run's local shards."""
    self._gathered = None
    slot, index = self._slots[position]
    value = checked_slot(value, slot, self.variables[index])
    length = slot.shape[0]
    flat = tf.reshape(padded(value, length, self.num_shards),
                      [self.num_shards, length])
    for replica, copy in zip(self._replica_ids,
                             self.strategy.experimental_local_results(
                                 _local(slot))):
      copy.assign(flat[replica])
