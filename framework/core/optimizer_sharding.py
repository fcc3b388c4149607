"""ZeRO-1, the one home: each replica, or each copy of a split on a mesh's
data axis, keeps 1/N of the optimizer's slots.

`ShardedOptimizerState` below shards over the replicas of one strategy;
`CopyShardedState` (at the end) over the R copies of a split model
(`--mesh=data:R,...`). Replicas first:

Data parallelism keeps a full copy of the optimizer state on every replica
(Adam: two slots, 2x the parameters). With `shard_optimizer_state` the
trainer splits every trainable variable, flattened and zero-padded to a
multiple of N, into N equal shards; replica r owns shard r:

    g_r   = reduce_scatter(grads)[r]      # this replica's [L] slice of
                                          # flat(sum of grads), padded
    clip_by_global_norm(g_r)              # norm: squares summed over replicas
    w_r   = flat(weight)[r*L:(r+1)*L]     # into a [L] shard variable
    update_step(g_r, w_r)                 # slots of shape [L]: 1/N each
    weight = all_gather(w_r)[:n]          # ReplicaContext.all_gather

The optimizer is built on the shard variables, so Keras's own `update_step`
(or the fused kernel) does the update and its slots are [L]-shaped
per-device copies, each holding its own replica's shard. Elementwise
optimizers only (SGD, momentum, Adam, AdamW): a shard's update must not
need the rest of the variable. The gradient is reduce-scattered
(`framework.distribute.collectives`: all-to-all + local sum), half the
bytes of an all-reduce; with all-reduce options other than the defaults it
is all-reduced whole and sliced. The cost is one all-gather of the weights
per step.

Checkpoints hold the full slots under the keys an unsharded run writes
(`checkpointed_optimizer`: the optimizer's own object graph with each slot
gathered at save and re-sliced at restore), so a run resumes with sharding
on or off and with another replica count.
"""

from __future__ import annotations

import math

import keras
import numpy as np
import tensorflow as tf

from framework import _tf_internal
from framework.distribute import collectives
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


def join_shards(shards, variable):
  """`variable`'s whole value from its R shards, in shard order (the
  padding dropped), where the caller's device scope puts it."""
  return unshard(tf.concat([tf.convert_to_tensor(s) for s in shards], 0),
                 variable)


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
                         name=f"{v.name}_shard",
                         # Read in its own dtype inside a mixed-precision
                         # layer call too (ZeRO-3 gathers it there).
                         autocast=False)
          for v in self.variables]
      optimizer.build(self.shards)
    self._replica_ids = self._local_replica_ids()
    self._slots = slot_parameters(optimizer, len(self.shards))
    self._gather_slots = tf.function(self._gather_slots_fn)
    self._gathered = None  # (iterations, [full slot]) of the last save
    self._scatter = None  # the gradients' reduce-scatter, made on first use
    self.checkpointed_optimizer = checkpoint_view(optimizer, {
        **{id(s): v for s, v in zip(self.shards, self.variables)},
        **saved_slots(self._slots, self._full_slot, self._restore_slot,
                      self.variables)})

  # --- The step (called by GradientPipeline). --------------------------------

  def local_shards(self, values, replica_id):
    """This replica's [L] slice of each full tensor in `values`."""
    # In the variable's static shape: an embedding's gradient, reduced as
    # IndexedSlices, converts to a tensor of unknown shape.
    return [shard_of(tf.reshape(tf.convert_to_tensor(value), variable.shape),
                     shard.shape[0], self.num_shards, replica_id)
            for value, shard, variable in zip(values, self.shards,
                                              self.variables)]

  def reduce_scatter(self, grads):
    """This replica's [L] slice of the SUM over replicas of each of
    `grads` (replica context): one reduce-scatter of all of them (per
    dtype), half the bytes an all-reduce moves."""
    if self._scatter is None:
      self._scatter = collectives.ReduceScatter(self.strategy)
    chunks = [tf.reshape(padded(tf.reshape(tf.convert_to_tensor(g), v.shape),
                                s.shape[0], self.num_shards),
                         [self.num_shards, s.shape[0]])
              for g, s, v in zip(grads, self.shards, self.variables)]
    shards = [None] * len(chunks)
    for dtype in dict.fromkeys(c.dtype for c in chunks):
      indices = [i for i, c in enumerate(chunks) if c.dtype == dtype]
      for i, shard in zip(indices, self._scatter([chunks[i] for i in indices])):
        shards[i] = shard
    return shards

  @property
  def replica_ids(self):
    """The global replica id of each of this process's copies of a shard."""
    return list(self._replica_ids)

  def index_of(self, variable):
    """The index of `variable` (a model variable) in `variables`, or None."""
    for i, v in enumerate(self.variables):
      if v is variable:
        return i
    return None

  def local_shard(self, index):
    """This replica's copy of shard `index`, read (replica context)."""
    return self._read_local([self.shards[index]])[0]

  def reduce_scatter_one(self, grad, index):
    """This replica's [L] slice of the SUM over replicas of `grad`, the
    whole gradient of variable `index` (replica context)."""
    if self._scatter is None:
      self._scatter = collectives.ReduceScatter(self.strategy)
    shard, variable = self.shards[index], self.variables[index]
    chunks = tf.reshape(
        padded(tf.reshape(tf.convert_to_tensor(grad), variable.shape),
               shard.shape[0], self.num_shards),
        [self.num_shards, shard.shape[0]])
    return self._scatter(chunks)

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


# ZeRO-1 on a mesh's data axis: copy r of the split keeps 1/R of the slots.
#
# A mesh with a data axis of R (`--mesh=data:R,model:S`, `data:R,pipeline:S`,
# or `--strategy=mirrored` with a split) trains R copies of the split in one
# program (`StagedTrainer`'s copies, each on its own devices; on a cluster,
# each on its own worker task). Unsharded, each copy has a full optimizer
# and all R apply the same update. With `shard_optimizer_state`, each
# variable of each copy, flattened and zero-padded to R * L elements, is cut
# into R slices of L; copy r keeps the optimizer's slots of slice r only, on
# the device of its copy of the variable:
#
#     g = all_reduce_copies(grads)            # whole on every copy: clipping
#                                             # by global norm sees it all
#     shard = flat(w)[r*L:(r+1)*L]            # copy r's [L] shard variable
#     update_step(flat(g)[r*L:(r+1)*L], shard)  # copy r's optimizer: [L] slots
#     w = concat(shard of copy 0..R-1)[:n]    # on each copy's device
#
# The last line is the all-gather: each copy's variable is assembled on its
# own device from the R updated slices, which TensorFlow sends device to
# device (every device receives the R-1 slices it lacks, what a ring
# all-gather moves). It is not TensorFlow's collective all-gather: the raw
# collective ops hang between logical CPU devices of one process unless they
# go through the cross-device ops (`replicas.py`), whose gather is private
# API; the concatenation runs unchanged on a cluster's remote devices.
# Each device then holds 1/R of the unsharded slots, plus the [L] shard of
# the weights the optimizer updates.
#
# ZeRO-2 (`shard_gradients`): the first line becomes a reduce-scatter over
# the copies (`copies.reduce_scatter_copies`), copy r receiving only
# flat(g)[r*L:(r+1)*L], and clipping takes the norm from the slices
# (`update_shards(..., scattered=True)`).
#
# Checkpoints hold the full slots under the keys copy 0's unsharded
# optimizer writes (`checkpointed_optimizer`, as `ShardedOptimizerState`
# does for mirrored replicas): a run resumes with sharding on or off and
# with another data axis, and the checkpoint evaluates on one device.
class CopyShardedState:
  """Each copy's shard variables and the optimizer built on them.

  Args:
    optimizers: R unbuilt optimizers of one class and config, copy 0's (the
      trainer's, checkpointed) first; the others count their steps in copy
      0's step counter.
    models: the R copies' models; copy r's variables are
      `models[r].trainable_variables` (the same order in every copy).
    strategy: the run's one-replica strategy (its scope builds the state).
  """

  def __init__(self, optimizers, models, strategy):
    check_elementwise(optimizers[0])
    self.optimizers = list(optimizers)
    self.num_shards = len(self.optimizers)
    self.variables = [list(m.trainable_variables) for m in models]
    self.shards = []
    with strategy.scope():
      for r, (optimizer, variables) in enumerate(zip(self.optimizers,
                                                     self.variables)):
        if r:
          _tf_internal.share_step_counter(optimizer,
                                          self.optimizers[0].iterations)
        shards = []
        for variable in variables:
          with tf.device(_local(variable).device):
            shards.append(keras.Variable(
                tf.zeros([shard_length(variable, self.num_shards)],
                         variable.dtype),
                trainable=False, name=f"{variable.name}_shard"))
        optimizer.build(shards)  # slots are placed with their shard
        self.shards.append(shards)
    self.reindex()  # copy r's variable (by id) -> its index in variables[r]
    self._slots = [slot_parameters(o, len(s))
                   for o, s in zip(self.optimizers, self.shards)]
    self.checkpointed_optimizer = checkpoint_view(self.optimizers[0], {
        **{id(s): v for s, v in zip(self.shards[0], self.variables[0])},
        **saved_slots(self._slots[0], self._full_slot, self._restore_slot,
                      self.variables[0])})

  def reindex(self):
    """Indexes the copies' variables again: after one was placed anew (a
    new tf.Variable behind the same Keras variable, `place_on_host`)."""
    self._index = [{id(_local(v)): i for i, v in enumerate(vs)}
                   for vs in self.variables]

  def shard(self, copy, variable):
    """Copy `copy`'s shard variable of its `variable`."""
    return self.shards[copy][self._index[copy][id(_local(variable))]]

  def checkpoint_index(self, variable):
    """The index of copy 0's `variable` in the per-variable lists of
    `checkpointed_optimizer` (those of the optimizer built on its shards)."""
    return self._index[0][id(_local(variable))]

  def optimizer_of(self):
    """{id of a copy r > 0's shard tf.Variable: copy r's optimizer}."""
    return {id(_local(shard)): optimizer
            for optimizer, shards in zip(self.optimizers[1:], self.shards[1:])
            for shard in shards}

  def slot_variables(self):
    """Every copy's slots ([L]-shaped, on their copy's devices)."""
    return [slot for slots in self._slots for slot, _ in slots]

  # --- The step (inside the trainer's tf.function). -------------------------

  def update_shards(self, update_variable, grads, variables, learning_rate,
                    scattered=False, in_place=False):
    """Copy r's slice of each of its variables, updated with its slice of
    the (summed) gradient.

    Args:
      update_variable: `(grad, var, learning_rate) -> op`, the trainer's
        (it runs on `var`'s device with `var`'s copy's optimizer).
      grads, variables: R lists, copy r's gradients and variables.
      scattered: copy r's `grads` are already its [L] slices
        (`copies.reduce_scatter_copies`, ZeRO-2), not whole gradients.
      in_place: the shards are the weights (ZeRO-3): updated as they are,
        not set from the variables first.
    """
    for r, (copy_grads, copy_variables) in enumerate(zip(grads, variables)):
      for grad, variable in zip(copy_grads, copy_variables):
        shard = self.shard(r, variable)
        # On the shard's device: ZeRO-3 on a mesh keeps copy 0's whole
        # variables on the host, away from the shards they were cut from.
        with tf.device(_local(shard).device):
          length = shard.shape[0]
          if not scattered:
            grad = shard_of(grad, length, self.num_shards, r)
          if in_place:
            update_variable(grad, shard, tf.cast(learning_rate, shard.dtype))
            continue
          weight = shard_of(variable, length, self.num_shards, r)
          with tf.control_dependencies([shard.assign(weight)]):
            update_variable(grad, shard, tf.cast(learning_rate, shard.dtype))

  def gather(self, variables):
    """The new full value of each of `variables` (R lists, copy r's), on
    its device: the R copies' updated slices joined (the all-gather)."""
    weights = []
    for r, copy_variables in enumerate(variables):
      for variable in copy_variables:
        index = self._index[r][id(_local(variable))]
        with tf.device(_local(variable).device):
          weights.append(join_shards(
              [_local(shards[index]) for shards in self.shards], variable))
    return weights

  # --- Checkpoints: full slots under copy 0's unsharded keys. ---------------

  def _full_slot(self, position):
    """Slot `position` of every copy joined, in its parameter's shape."""
    index = self._slots[0][position][1]
    flat = np.concatenate([slots[position][0].numpy()
                           for slots in self._slots])
    return unshard(tf.constant(flat), self.variables[0][index])

  def _restore_slot(self, position, value):
    """A full slot (from a sharded or unsharded run, any data axis) cut
    into the copies' slices."""
    slot, index = self._slots[0][position]
    value = checked_slot(value, slot, self.variables[0][index])
    length = slot.shape[0]
    flat = tf.reshape(padded(value, length, self.num_shards),
                      [self.num_shards, length])
    for r, slots in enumerate(self._slots):
      slots[position][0].assign(flat[r])
