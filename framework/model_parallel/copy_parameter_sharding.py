"""ZeRO-3 on a mesh's data axis: a split's copies keep 1/R of every
weight (`shard_parameters` with `--mesh=data:R,pipeline:S`, or
`--mesh=data:R,model:M` for a model with a whole-model tensor split, the
GPT).

ZeRO-1 and 2 on the data axis (`optimizer_sharding.CopyShardedState`,
`copies.reduce_scatter_copies`) give copy r the shard variables `w_r` (the
[L]-element slice r of each flattened, zero-padded weight of its stages, on
its stages' devices) and the slots of them. Here the shards are the
weights the step trains. Every stage of every copy, per micro-batch (and
per accumulation step), runs

    W = concat(w_0 .. w_R-1)       # its weights joined on its device when
                                   # its inputs exist (`StageShards.gather`)
    y = stage(x; W)                # the layers read W (keras.StatelessScope),
                                   # their state written back (BatchNorm
                                   # statistics, seed counters)
    backward: W = concat(...)      # joined again: the stage is recomputed
              dx, dW = grad(stage)
    g_r = reduce_scatter(dW)       # over the copies, as ZeRO-2 does

so a device holds its 1/R of the weights, gradients and slots, and one
micro-batch's worth of its stage's whole weights at a time. The update is
ZeRO-2's on the shards, in place, with nothing joined after it
(`updates.CopyShardedParametersUpdate`).

Copy 0's model variables (on its stages' devices) keep the whole weights
for everything outside the step: checkpoints (the unsharded run's keys),
evaluation, export, summaries. They are joined from the shards when
`train` returns (`store`, which fingerprints them) and cut into every
copy's shards when it starts (`load`), each only where it changed in
between (a restore, a rollback, a warm start, a user's assignment). The
other copies' model variables are not read by the step.
"""

import functools

import keras
import tensorflow as tf

from framework.core.optimizer_sharding import padded, unshard
from framework.errors import ConfigError
from framework.model_parallel import fingerprints
from framework.model_parallel.devices import variable_device
from framework.model_parallel.parallel_layers import WeightScope


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

  def __init__(self, state, copy, variables, state_variables):
    index = {id(_tf(v)): i for i, v in enumerate(state.variables[copy])}
    self.state = state
    self.variables = list(variables)
    self.indices = [index[id(_tf(v))] for v in self.variables]
    self.state_variables = list(state_variables)

  def gather(self, after):
    """Each variable's whole value, joined on its device (a pipeline
    stage's, or a tensor split's device position) from the R copies'
    shards once `after` exist."""
    shards = self.state.shards
    weights = []
    with tf.name_scope("gather_weights/"), tf.control_dependencies(after):
      for i, v in zip(self.indices, self.variables):
        with tf.device(variable_device(v)):
          weights.append(unshard(tf.concat(
              [tf.convert_to_tensor(_tf(s[i])) for s in shards], 0), v))
    return weights

  def run(self, fn, after, tape=None):
    """(fn()'s outputs, the gathered weights): `fn` runs the stage's
    layers on the weights gathered once `after` exist.

    Args:
      fn: `() -> outputs` (a nest of tensors).
      after: tensors the gathering waits for (the stage's inputs).
      tape: the recomputed pass's tape: it watches the weights, and what
        the layers write to their state is dropped (the forward pass wrote
        it); None: the forward pass, whose writes are kept.
    """
    weights = self.gather(after)
    if tape is not None:
      tape.watch(weights)
    # A WeightScope: a tensor split's `on_device` blocks take the weights
    # as inputs, so the tape differentiates them through its placed passes.
    with WeightScope(self.variables, weights, collect_losses=True) as scope:
      outputs = fn()
    if scope.losses:
      raise ConfigError(
          "shard_parameters=True: the model's layers add losses in their "
          "call (add_loss, activity_regularizer), which its recomputed "
          "stages do not differentiate; turn shard_parameters off")
    if tape is not None:
      return outputs, weights
    # What the layers wrote, as Keras writes it outside a stateless scope;
    # the outputs wait for it (the next micro-batch reads the new state).
    writes = []
    for v in self.state_variables:
      new = scope.get_current_value(v)
      if new is not None:
        writes.append(v.assign(new))
    with tf.control_dependencies(writes):
      return tf.nest.map_structure(_identity_in_place, outputs), weights


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
        joined = unshard(tf.concat([tf.convert_to_tensor(_tf(s[i]))
                                    for s in state.shards], 0), variable)
        variable.assign(joined)
        if _tf(variable).shape.num_elements():
          self._stored[i].assign(fingerprints.fingerprint(joined))
