"""ZeRO-3 on a mesh's data axis: a split's copies keep 1/R of every
weight (`shard_parameters` with `--mesh=data:R,pipeline:S`, or
`--mesh=data:R,model:M` for a model with a whole-model tensor split, the
GPT).

ZeRO-1 and 2 on the data axis (`optimizer_sharding.CopyShardedState`,
`copies.reduce_scatter_copies`) give copy r the shard variables `w_r` (the
[L]-element slice r of each flattened, zero-padded weight of its stages, on
its stages' devices) and the slots of them. Here the shards are the
weights the step trains. Every block of every copy, per micro-batch (and
per accumulation step), runs

    W = concat(w_0 .. w_R-1)       # the weights it reads, joined on its
                                   # device once its inputs exist
    y = block(x; W)                # the layers read W (`WeightScope`);
                                   # W is dropped when the block is done
    backward: W = concat(...)      # joined again once d y exists: the
              dx, dW = grad(block) # block runs again (its inputs kept)
              dw_r = slice r of dW # the join's gradient, per copy
    g_r = sum over copies of dw_r  # on copy r's device, in copy order:
                                   # ZeRO-2's reduce-scatter, weight by
                                   # weight (`copies.sum_slices_copies`)

A block is a placed block of a transformer split (`parallel_layers.
on_device`: a sub-layer's shard, a residual add, the lookup, the head) or,
on a pipeline stage, one call of a layer with weights (`StageShards.call`),
so a device holds its 1/R of the weights, gradients and slots and the
weights of one block at a time (two when one block's backward pass
overlaps the next one's join). The update is ZeRO-2's on the shards, in
place, with nothing joined after it (`updates.CopyShardedParametersUpdate`).

Copy 0's model variables keep the whole weights for everything outside
the step: checkpoints (the unsharded run's keys), evaluation, export,
summaries. They live on the host of copy 0's devices (`place_on_host`:
its task's CPU, as the model's own variables under a mirrored strategy),
so no device of the mesh holds a whole weight outside a block. They are
joined from the shards when `train` returns (`store`, which fingerprints
them) and cut into every copy's shards when it starts (`load`), each only
where it changed in between (a restore, a rollback, a warm start, a
user's assignment). The other copies' trainable variables are released
(`release`): every device keeps only its 1/R of the weights.
"""

import functools

import keras
import tensorflow as tf

from framework import _tf_internal
from framework.core.optimizer_sharding import join_shards, padded
from framework.errors import ConfigError
from framework.model_parallel import fingerprints
from framework.model_parallel.devices import host_device
from framework.model_parallel.parallel_layers import WeightScope, on_device


def _tf(variable):
  """The tf.Variable behind a Keras variable (outside a stateless scope)."""
  return variable.value if isinstance(variable, keras.Variable) else variable


class StageShards:
  """One copy's stage: its weights joined from the R copies' shards.

  Args:
    state: the split's `optimizer_sharding.CopyShardedState`.
    copy: the copy's index r.
    variables: the stage's trainable variables (copy r's).
    state_variables: the stage's layers' non-trainable variables.
  """

  def __init__(self, state, copy, variables, state_variables,
               layer_device=None):
    index = {id(_tf(v)): i for i, v in enumerate(state.variables[copy])}
    self.state = state
    self.variables = list(variables)
    self.indices = [index[id(_tf(v))] for v in self.variables]
    self.state_variables = list(state_variables)
    self.layer_device = layer_device

  def call(self, layer, call, args, kwargs):
    """`call(*args, **kwargs)`, the stage's call of `layer`: with a
    `layer_device`, a layer with weights runs as one placed block there
    (`parallel_layers.on_device`: its weights joined when its inputs
    exist, and again in the backward pass, which runs it again); its
    float tensors are the block's inputs, anything else is closed over."""
    # A functional graph's nodes also hold plain ops (the `not_equal` of
    # an Embedding's mask_zero): they have no weights. Outside the step
    # (evaluation, prediction: no `WeightScope`) the layers read copy 0's
    # whole weights as they are, with no block to differentiate.
    if (self.layer_device is None
        or not getattr(layer, "trainable_variables", None)
        or not isinstance(_tf_internal.stateless_scope(), WeightScope)):
      return call(*args, **kwargs)
    structure = (list(args), dict(kwargs))
    flat = tf.nest.flatten(structure)
    floats = [i for i, t in enumerate(flat)
              if tf.is_tensor(t) and t.dtype.is_floating]

    def block(*tensors):
      full = list(flat)
      for i, t in zip(floats, tensors):
        full[i] = t
      block_args, block_kwargs = tf.nest.pack_sequence_as(structure, full)
      return call(*block_args, **block_kwargs)

    return on_device(self.layer_device, block, *[flat[i] for i in floats])

  def parts(self):
    """For each variable, the R copies' shards of it (copy 0's first)."""
    shards = self.state.shards
    return [tuple(tf.convert_to_tensor(_tf(s[i])) for s in shards)
            for i in self.indices]

  def run(self, fn, after, tape=None, keep_writes=None):
    """(fn()'s outputs, each variable's R shard tensors): `fn` runs the
    stage's layers on weights joined from the shards where they are read
    (`parallel_layers.WeightScope`): a layer's read outside a placed block
    joins its weight on its device once `after` exist; a tensor split's
    placed blocks join what they read, forward and again backward.

    Args:
      fn: `() -> outputs` (a nest of tensors).
      after: tensors the joins wait for (the stage's inputs).
      tape: the tape the pass records on (it watches the shard tensors, so
        the gradients are the shards', slice by slice), or None.
      keep_writes: keep what the layers write to their state (BatchNorm
        statistics, seed counters); default: without a tape (a recomputed
        pass drops it: the forward pass wrote it).
    """
    if keep_writes is None:
      keep_writes = tape is None
    parts = self.parts()
    if tape is not None:
      tape.watch(parts)
    with WeightScope(self.variables, shards=parts, after=after,
                     collect_losses=True) as scope:
      outputs = fn()
    if scope.losses:
      raise ConfigError(
          "shard_parameters=True: the model's layers add losses in their "
          "call (add_loss, activity_regularizer), which its recomputed "
          "stages do not differentiate; turn shard_parameters off")
    if not keep_writes:
      return outputs, parts
    # What the layers wrote, as Keras writes it outside a stateless scope;
    # the outputs wait for it (the next micro-batch reads the new state).
    writes = []
    for v in self.state_variables:
      new = scope.get_current_value(v)
      if new is not None:
        writes.append(v.assign(new))
    with tf.control_dependencies(writes):
      return tf.nest.map_structure(_identity_in_place, outputs), parts


def release(variable):
  """Frees a copy's whole weight (ZeRO-3: the step reads the shards, and
  copy 0's variables are the whole weights everything else reads): the
  variable, the same object on the same device with the same static
  shape, then holds an empty tensor."""
  handle = _tf(variable)
  with tf.device(handle.device):
    tf.raw_ops.AssignVariableOp(
        resource=handle.handle, value=tf.zeros([0], dtype=handle.dtype),
        validate_shape=False)


def place_on_host(variable):
  """Moves copy 0's whole weight to its devices' host (ZeRO-3: the step
  reads the shards; checkpoints, evaluation and export read this copy, as
  the model's host copy under a mirrored strategy): the same Keras variable
  and value, a new tf.Variable behind it on the host's CPU."""
  value = _tf(variable)
  with tf.init_scope(), tf.device(host_device(value.device)):
    _tf_internal.initialize_variable(variable, tf.identity(value))


def _identity_in_place(tensor):
  """`tf.identity(tensor)` on the tensor's own device: a tensor split's
  outputs stay on their shard devices (its loss places its blocks where
  they are)."""
  with tf.device(tensor.device):
    return tf.identity(tensor)


class CopyParameterSharding:
  """Copy 0's model variables <-> every copy's shards (outside the step).

  Args:
    state: the split's `optimizer_sharding.CopyShardedState`.
  """

  def __init__(self, state):
    self.state = state
    # The fingerprint of each of copy 0's variables as `store` left it, on
    # its device (-1: none yet, never a fingerprint). Not checkpointed.
    self._stored = []
    with tf.init_scope():
      for variable in state.variables[0]:
        with tf.device(_tf(variable).device):
          self._stored.append(tf.Variable(
              tf.fill([2], tf.constant(-1, tf.int64)), trainable=False,
              name="stored_fingerprint"))
    self._load_fn = tf.function(self._load, autograph=False)
    self._store_fn = tf.function(self._store, autograph=False)

  def load(self):
    """Cuts copy 0's variables into every copy's shards at the start of
    every `train`, each only where it changed since `store` (a restore, a
    rollback, a warm start, a user's assignment): the shards still hold
    what `store` joined. Returns the bytes assigned to the shards (an int64
    scalar tensor)."""
    return self._load_fn()

  def store(self):
    """Joins the shards into copy 0's variables (and fingerprints them):
    at the end of every `train`."""
    self._store_fn()

  def _load(self):
    state = self.state
    moved = [tf.zeros([], tf.int64)]
    for i, variable in enumerate(state.variables[0]):
      variable = _tf(variable)
      if not variable.shape.num_elements():
        continue
      with tf.device(variable.device):
        changed = fingerprints.differs(fingerprints.fingerprint(variable),
                                       self._stored[i])
      moved.append(tf.cond(changed, functools.partial(self._cut, i),
                           lambda: tf.constant(0, tf.int64)))
    return tf.add_n(moved)

  def _cut(self, i):
    """Copy 0's variable i cut into the R copies' shards; their bytes."""
    state = self.state
    variable = _tf(state.variables[0][i])
    length = state.shards[0][i].shape[0]
    with tf.device(variable.device):
      rows = tf.reshape(padded(tf.convert_to_tensor(variable), length,
                               state.num_shards),
                        [state.num_shards, length])
    assigns = []
    for r, shards in enumerate(state.shards):
      with tf.device(_tf(shards[i]).device):
        assigns.append(shards[i].assign(rows[r]))
    with tf.control_dependencies(assigns):
      return tf.constant(
          state.num_shards * length * tf.as_dtype(variable.dtype).size,
          tf.int64)

  def _store(self):
    state = self.state
    for i, variable in enumerate(state.variables[0]):
      with tf.device(_tf(variable).device):
        joined = join_shards([_tf(s[i]) for s in state.shards], variable)
        variable.assign(joined)
        if _tf(variable).shape.num_elements():
          self._stored[i].assign(fingerprints.fingerprint(joined))
