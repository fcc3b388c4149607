"""ZeRO-1 on a mesh's data axis: copy r of the split keeps 1/R of the slots.

A mesh with a data axis of R (`--mesh=data:R,model:S`, `data:R,pipeline:S`,
or `--strategy=mirrored` with a split) trains R copies of the split in one
program (`StagedTrainer`'s copies, each on its own devices; on a cluster,
each on its own worker task). Unsharded, each copy has a full optimizer
and all R apply the same update. With `shard_optimizer_state`, each
variable of each copy, flattened and zero-padded to R * L elements, is cut
into R slices of L; copy r keeps the optimizer's slots of slice r only, on
the device of its copy of the variable:

    g = all_reduce_copies(grads)            # whole on every copy: clipping
                                            # by global norm sees it all
    shard = flat(w)[r*L:(r+1)*L]            # copy r's [L] shard variable
    update_step(flat(g)[r*L:(r+1)*L], shard)  # copy r's optimizer: [L] slots
    w = concat(shard of copy 0..R-1)[:n]    # on each copy's device

The last line is the all-gather: each copy's variable is assembled on its
own device from the R updated slices, which TensorFlow sends device to
device (every device receives the R-1 slices it lacks, what a ring
all-gather moves). It is not TensorFlow's collective all-gather: the raw
collective ops hang between logical CPU devices of one process unless they
go through the cross-device ops (`replicas.py`), whose gather is private
API; the concatenation runs unchanged on a cluster's remote devices.
Each device then holds 1/R of the unsharded slots, plus the [L] shard of
the weights the optimizer updates.

Checkpoints hold the full slots under the keys copy 0's unsharded
optimizer writes (`checkpointed_optimizer`, as `ShardedOptimizerState`
does for mirrored replicas): a run resumes with sharding on or off and
with another data axis, and the checkpoint evaluates on one device.
"""

import keras
import numpy as np
import tensorflow as tf

from framework import _tf_internal
from framework.core.optimizer_sharding import (check_elementwise,
                                               checked_slot, checkpoint_view,
                                               padded, saved_slots,
                                               shard_length, shard_of,
                                               slot_parameters, unshard)


def _local(variable):
  """The tf.Variable behind a Keras variable."""
  return getattr(variable, "value", variable)


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
    # Copy r's variable (by id) -> its index in `variables[r]`.
    self._index = [{id(_local(v)): i for i, v in enumerate(vs)}
                   for vs in self.variables]
    self._slots = [slot_parameters(o, len(s))
                   for o, s in zip(self.optimizers, self.shards)]
    self.checkpointed_optimizer = checkpoint_view(self.optimizers[0], {
        **{id(s): v for s, v in zip(self.shards[0], self.variables[0])},
        **saved_slots(self._slots[0], self._full_slot, self._restore_slot,
                      self.variables[0])})

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

  def update_shards(self, update_variable, grads, variables, learning_rate):
    """Copy r's slice of each of its variables, updated with its slice of
    the (summed) gradient.

    Args:
      update_variable: `(grad, var, learning_rate) -> op`, the trainer's
        (it runs on `var`'s device with `var`'s copy's optimizer).
      grads, variables: R lists, copy r's gradients and variables.
    """
    for r, (copy_grads, copy_variables) in enumerate(zip(grads, variables)):
      for grad, variable in zip(copy_grads, copy_variables):
        shard = self.shards[r][self._index[r][id(_local(variable))]]
        with tf.device(_local(variable).device):
          length = shard.shape[0]
          weight = shard_of(variable, length, self.num_shards, r)
          grad = shard_of(grad, length, self.num_shards, r)
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
          joined = tf.concat([tf.convert_to_tensor(_local(shards[index]))
                              for shards in self.shards], 0)
          weights.append(unshard(joined, variable))
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
