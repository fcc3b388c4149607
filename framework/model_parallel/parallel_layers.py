"""Megatron-style tensor-parallel layers, their placed primitives, and the
checkpoint keys of a split model's optimizer.

    on_device(device, fn, *xs)   forward fn(*xs) on `device`, recorded on a
                                 tape of its own; backward that tape's
                                 gradient, also on `device`
    all_reduce([p_0, ...])       forward: sum_d p_d on every device
                                 (TensorFlow's collective all-reduce, one
                                 CollectiveReduceV2 per device);
                                 backward: the same all-reduce of the
                                 incoming gradients
    ColumnParallelLinear         kernel [n, k] cut by output columns: shard d
                                 computes x W[:, d] (+ b[d]) from the full x
    RowParallelLinear            kernel [k, n] cut by input rows: shard d
                                 computes the partial product x_d W[d, :];
                                 the sum (`all_reduce`) plus the bias is the
                                 layer's output on every device
    VocabParallelEmbedding       token table [V, W] cut by vocabulary: shard
                                 d looks up the ids in its range (zeros
                                 elsewhere; the all-reduce sums the shards),
                                 and its reverse gives shard d's logits
                                 [.., V/D]
    vocab_parallel_cross_entropy the softmax cross-entropy over logit shards,
                                 from per-shard log-sum-exps: the full
                                 logits are never gathered
    unsplit_view                 a split model's optimizer under the unsplit
                                 model's checkpoint keys

A tensor-parallel model keeps one tensor per shard device (`[x_0, ...,
x_{D-1}]`, x_d on devices[d]) and runs each shard's math on its device.
`tf.GradientTape` does not put gradient ops next to their forward ops (they
land wherever `tape.gradient` runs), so both primitives place their
backward pass themselves, with `tf.custom_gradient`. The all-reduce's
backward is the exact gradient of "every device gets the sum" (d p_e =
sum_d d s_d), so the whole split model is an ordinary differentiable
function and a variable read on several devices (a replicated layer norm)
just gets the sum of its per-device gradients. One transformer sub-layer
(attention or MLP) then costs one all-reduce forward and one backward, as
Megatron's f/g pair does.

A layer's shard methods (`shard`, `partial`, `lookup`, `logits`) compute
one device's part; the caller runs them under `on_device` (the GPT), or
takes the column and row layers' `shards[d]` (and the row's
`output_layer`) as the layers of device-pinned stages (a Dense pair,
`tensor_parallel`). Each cut weight
is a `ShardedWeight`: one checkpoint entry, the whole tensor, under the
path the unsplit layer's weight has, so a checkpoint of a split model
restores into the unsplit one (and into other splits), and back.

The optimizer's keys: Keras keeps an optimizer's per-variable state in
lists indexed by the variables it was built on (the first moment of
variable 3 is element 3 of one list, and the flat list of all its variables
interleaves them), and a checkpoint stores each by that index. A tensor
split trains other variables (each cut weight is D shards), so its
optimizer alone would write other indices and shapes than an unsplit run's:
a run resumed on another mesh, or on none, would fail on a shape or, where
shapes agree, restore another variable's slots. `unsplit_view` is the
object graph an unsplit run's optimizer has: the same children, each
per-variable list in the unsplit model's variable order, each cut slot one
whole tensor (a `ShardedWeight` over its shards' slots, joined at save and
cut again at restore), the model's weights the split's own
`ShardedWeight`s. A checkpoint of any mesh then restores into any other,
and the optimizer state with it.
"""

import contextlib
import functools
import re

import keras
import numpy as np
import tensorflow as tf

from framework import _tf_internal
from framework.core.checkpoints import sharding
from framework.core.optimizer_sharding import join_shards, padded
from framework.errors import ConfigError, check_positive
# split_for: app/experiment.py's import; its home is config.py (import it
# from there, and this line goes).
from framework.model_parallel.config import split_for  # pylint: disable=unused-import
from framework.model_parallel.copies import SUM, collective_all_reduce
from framework.model_parallel.devices import short_device, variable_device


class WeightScope(keras.StatelessScope):
  """A `keras.StatelessScope` whose values are weights a tape
  differentiates: the layers read, for `variables[i]`, `weights[i]`, or
  (ZeRO-3) the whole weight joined from `shards[i]`, its R copies' [L]
  shards, where it is read.

  A read outside a placed block joins it on the variable's device once
  `after` exist (once per scope). A placed block (`on_device`) takes the
  scope's tensors as inputs (a custom gradient gives gradients to its
  inputs and to the variables it reads, not to tensors it closes over) and
  joins each weight it reads on its own device after its inputs: forward,
  and again in its backward pass, which recomputes the block; the joined
  weight lives only while the block runs. A block's gradient for a sharded
  weight is its R slices (cut as the shards are).

  Args:
    variables: the Keras variables the layers read.
    weights: the whole value standing for each (or `shards`).
    shards: for each, its R shard tensors ([L] each, zero-padded).
    after: tensors a join outside a block waits for.
    **kwargs: `keras.StatelessScope`'s (`collect_losses`).
  """

  def __init__(self, variables, weights=None, *, shards=None, after=(),
               **kwargs):
    if (weights is None) == (shards is None):
      raise ValueError("WeightScope takes weights or shards (one of them)")
    self.variables = list(variables)
    self.sharded = shards is not None
    self.parts = ([tuple(s) for s in shards] if self.sharded
                  else [(w,) for w in weights])
    if len(self.parts) != len(self.variables):
      raise ValueError(f"WeightScope got {len(self.parts)} weights for "
                       f"{len(self.variables)} variables")
    self.after = list(after)
    self.index = {id(v): i for i, v in enumerate(self.variables)}
    self._joined = {}
    super().__init__(**kwargs)

  def join(self, i, parts, after):
    """Variable i's whole value from `parts` (its tensors), here, once
    `after` exist."""
    with tf.name_scope("gather_weights"), tf.control_dependencies(after):
      # The copies onto this device wait, not only the ops after them.
      parts = [tf.identity(p) for p in parts]
      if not self.sharded:
        return parts[0]
      return join_shards(parts, self.variables[i])

  def cut(self, i, grad):
    """The gradient of variable i's whole value -> its parts' gradients."""
    if not self.sharded:
      return [grad]
    count, length = len(self.parts[i]), self.parts[i][0].shape[0]
    grad = tf.reshape(tf.convert_to_tensor(grad), self.variables[i].shape)
    rows = tf.unstack(tf.reshape(padded(grad, length, count),
                                 [count, length]), count)
    # Each slice in a buffer of its own: the unstacked rows share the
    # gradient's, and summing them over blocks and copies then gave results
    # that changed from run to run (measured: half of 30 repeated steps).
    return [tf.raw_ops.DeepCopy(x=row) for row in rows]

  def get_current_value(self, variable):
    i = self.index.get(id(variable))
    if i is None:
      return super().get_current_value(variable)
    if i not in self._joined:
      with tf.device(variable_device(variable)):
        self._joined[i] = self.join(i, self.parts[i], self.after)
    return self._joined[i]


class _BlockReads(keras.StatelessScope):
  """Inside an `on_device` block under a `WeightScope`: a read of weight i
  joins `parts[i]` (the block's inputs standing for it) on the block's
  device once `after` exist, at its first read (`tape`: watched); any
  other variable reads through the enclosing scope, and its value at the
  block's first read is kept (`first`) for the recomputation; updates and
  losses go to the enclosing scope (`outer`, None in a recomputation:
  they are dropped, the forward pass made them)."""

  def __init__(self, scope, parts, after, outer=None, tape=None,
               first=()):
    super().__init__(state_mapping=list(first),
                     collect_losses=bool(outer and outer.collect_losses))
    self.scope, self.parts, self.after = scope, parts, after
    self.outer, self.tape = outer, tape
    self.joined = {}  # weight index -> its value joined on the block's device
    self.first = {}  # id(variable) -> (variable, value at the first read)

  def get_current_value(self, variable):
    i = self.scope.index.get(id(variable))
    if i is not None:
      if i not in self.joined:
        self.joined[i] = self.scope.join(i, self.parts[i], self.after)
        if self.tape is not None:
          self.tape.watch(self.joined[i])
      return self.joined[i]
    if self.outer is None:  # a recomputation: the forward pass's values
      return super().get_current_value(variable)
    value = self.outer.get_current_value(variable)
    if id(variable) not in self.first:
      if value is None:
        value = _tf_internal.stored_value(variable)
      self.first[id(variable)] = (variable, value)
    elif value is None:
      value = self.first[id(variable)][1]
    return value

  def add_update(self, update):
    if self.outer is not None:
      self.outer.add_update(update)
    else:
      super().add_update(update)

  def add_loss(self, loss):
    if self.outer is not None:
      self.outer.add_loss(loss)


def on_device(device, fn, *inputs):
  """`fn(*inputs)` on `device`, forward and backward.

  Args:
    device: where the ops of `fn` and of its gradient run.
    fn: `(*tensors) -> tensor or tuple of tensors`; may read variables
      (their gradients are returned to the enclosing tape), or under a
      `WeightScope` the weights standing for them (their gradients too:
      the block is then run again in its backward pass, see `WeightScope`).
    *inputs: float tensors (integers, e.g. token ids, are closed over by
      `fn` instead: they have no gradient).
  """
  scope = _tf_internal.stateless_scope()
  if isinstance(scope, _BlockReads):
    # The inner block's custom gradient would not see the outer block's
    # joined weights: their gradients would be lost.
    raise ValueError("on_device blocks do not nest under a WeightScope "
                     "(ZeRO-3's joined weights); call them one after another")
  if isinstance(scope, WeightScope):
    return _joining_block(scope, device, fn, inputs)
  count = len(inputs)

  @tf.custom_gradient
  def block(*xs):
    with tf.device(device):
      with tf.GradientTape() as tape:
        # One copy onto this device, watched, instead of one per consumer.
        local = [tf.identity(x) for x in xs]
        tape.watch(local)
        outputs = fn(*local)
    flat = tf.nest.flatten(outputs)

    def grad(*output_grads, variables=None):
      variables = list(variables or [])
      with tf.device(device):
        grads = tape.gradient(
            flat, local + variables, output_gradients=list(output_grads),
            unconnected_gradients=tf.UnconnectedGradients.ZERO)
      return grads[:count], grads[count:]

    return outputs, grad

  with tf.device(device):
    # Outputs that name their device (`vocab_parallel_statistics` reads it).
    return tf.nest.map_structure(tf.identity, block(*inputs))


def _joining_block(scope, device, fn, inputs):
  """`on_device` under a `WeightScope`: the block joins the weights it
  reads after its inputs, keeps only its inputs for the backward pass, and
  there joins them again and runs `fn` again (with the values the forward
  pass read of every other variable: the same dropout masks)."""
  count = len(inputs)
  sizes = [len(p) for p in scope.parts]
  flat_parts = [t for p in scope.parts for t in p]

  def grouped(flat):
    out, start = [], 0
    for n in sizes:
      out.append(tuple(flat[start:start + n]))
      start += n
    return out

  @tf.custom_gradient
  def block(*xs):
    parts = grouped(xs[count:])
    with tf.device(device):
      # One copy onto this device instead of one per consumer; the joins
      # wait for it (one block's weights at a time).
      local = [tf.identity(x) for x in xs[:count]]
      with _BlockReads(scope, parts, local + scope.after,
                       outer=scope) as reads:
        outputs = fn(*local)

    def grad(*output_grads, variables=None):
      variables = list(variables or [])
      with tf.device(device), tf.name_scope("block_backward"):
        # Joined again once the output gradients exist: in the backward
        # pass, not kept from the forward one.
        waits = tf.nest.flatten(list(output_grads), expand_composites=True)
        with tf.control_dependencies(waits):
          again = [tf.identity(x) for x in xs[:count]]
          started = [tf.identity(waits[0])] if waits else []
        with tf.GradientTape() as tape:
          tape.watch(again)
          with _BlockReads(scope, parts, again + started, tape=tape,
                           first=reads.first.values()) as replay:
            redo = tf.nest.flatten(fn(*again))
        joined = sorted(replay.joined.items())
        grads = tape.gradient(
            redo, again + [w for _, w in joined] + variables,
            output_gradients=list(output_grads),
            unconnected_gradients=tf.UnconnectedGradients.ZERO)
      # A weight this block did not read gets no gradient (not a zero).
      part_grads = [[None] * n for n in sizes]
      for (i, _), g in zip(joined, grads[count:count + len(joined)]):
        with tf.device(device):
          part_grads[i] = scope.cut(i, g)
      return (grads[:count] + [g for p in part_grads for g in p],
              grads[count + len(joined):])

    return outputs, grad

  with tf.device(device):
    # Outputs that name their device (`vocab_parallel_statistics` reads it).
    return tf.nest.map_structure(tf.identity, block(*inputs, *flat_parts))


def _sum_on_every_device(values, devices):
  """`sum(values)` on each of `devices` (value d already on devices[d])."""
  if len(values) == 1:
    return [tf.identity(values[0])]
  summed = collective_all_reduce(tuple(devices)).reduce(
      SUM, _tf_internal.per_replica(values),
      destinations=_tf_internal.per_replica(values))
  return list(summed.values)


def all_reduce(values, devices):
  """`[sum(values)] * D`, copy d on devices[d]; its gradient likewise.

  Args:
    values: D tensors of one shape, values[d] on devices[d].
    devices: the D shard devices (one collective group).
  """
  devices = tuple(devices)
  if len(values) != len(devices):
    raise ValueError(f"all_reduce got {len(values)} values for "
                     f"{len(devices)} devices")

  @tf.custom_gradient
  def reduce(*parts):
    def grad(*output_grads):
      return _sum_on_every_device(list(output_grads), devices)

    return tuple(_sum_on_every_device(list(parts), devices)), grad

  return list(reduce(*values))


def all_gather(values, devices):
  """`stack(values)` [D, ...] on every device (an all-reduce of one-hot
  placed copies: each device contributes its slot, zeros elsewhere)."""
  num = len(devices)
  placed = []
  for d, (value, device) in enumerate(zip(values, devices)):
    with tf.device(device):
      slot = tf.one_hot(d, num, dtype=value.dtype)
      placed.append(tf.reshape(slot, [num] + [1] * value.shape.rank) *
                    value[tf.newaxis])
  return all_reduce(placed, devices)


def maybe_device(devices):
  """`tf.device(devices[0])`, or no scope when `devices` is empty."""
  return tf.device(devices[0]) if devices else contextlib.nullcontext()


_VALUE = _tf_internal.VARIABLE_VALUE_KEY


def check_divides(num_shards, **sizes):
  """Raises ConfigError unless `num_shards` divides every size."""
  for name, size in sizes.items():
    if size % num_shards:
      divisors = [d for d in range(1, size + 1) if size % d == 0]
      raise ConfigError(
          f"num_shards={num_shards} does not divide {name}={size}; a tensor "
          f"split needs a divisor of it ({', '.join(map(str, divisors))})")


# The base class of objects a tf.train.Checkpoint saves (children by
# `_trackable_children`, values by `_serialize_to_tensors`).
CheckpointNode = _tf_internal.Trackable


class ShardedWeight(_tf_internal.Trackable):
  """One logical weight stored as D variables cut along `axis`.

  Checkpointed as the whole tensor: the key is the one an unsplit layer's
  variable at the same path has. Joined on the host (`gathered`), or, under
  `checkpoint_sharding=by_task`, one slice of that tensor per shard, each
  written from its shard's device (`framework.core.checkpoints.sharding`).
  A restore reads the whole tensor (out of either) and splits it.
  """

  def __init__(self, shards, axis):
    self.shards = list(shards)
    self.axis = axis
    shape = list(self.shards[0].shape)
    shape[axis] = sum(int(s.shape[axis]) for s in self.shards)
    self.shape = tuple(shape)

  @property
  def dtype(self):
    return self.shards[0].dtype

  @property
  def path(self):
    """The unsplit variable's path: shard 0's without its `shard_0`
    (`dense/kernel` for `dense/kernel_shard_0` or `dense/shard_0/kernel`)."""
    path = getattr(self.shards[0], "path", None)
    return path and re.sub(r"/shard_0(?=/)|_shard_0$", "", path)

  def _slices(self):
    """[(slice spec, shard)]: where each shard sits in the whole tensor;
    None unless every shard is a variable (a ZeRO-1 slot's shards are
    views that gather across copies: they save whole)."""
    if not all(isinstance(s, (tf.Variable, keras.Variable))
               for s in self.shards):
      return None
    slices, offset = [], 0
    for shard in self.shards:
      shape = [int(n) for n in shard.shape]
      start = [0] * len(shape)
      start[self.axis] = offset
      offset += shape[self.axis]
      spec = tf.Variable.SaveSliceInfo(
          full_name=_VALUE, full_shape=list(self.shape), var_offset=start,
          var_shape=shape).spec.strip()
      slices.append((spec, shard))
    return slices

  def _serialize_to_tensors(self):
    slices = self._slices() if sharding.by_task() else None
    if slices:
      # Each slice read on its shard's device: the task holding it writes
      # it, nothing is joined.
      tensors = {}
      for spec, shard in slices:
        value = shard.value if isinstance(shard, keras.Variable) else shard
        with tf.device(value.device):
          tensors[spec] = tf.identity(value)
      return {_VALUE: tensors}
    # The whole tensor, joined on the host (where a checkpoint writes every
    # variable from anyway): the unsplit layer's entry, so that any split,
    # or none, restores it.
    with tf.device("/CPU:0"):
      return {_VALUE: tf.concat([tf.identity(getattr(s, "value", s))
                                 for s in self.shards], axis=self.axis)}

  def _restore_from_tensors(self, restored_tensors):
    # Restored inside a multi-worker function the value has no static
    # shape; tf.split needs its rank.
    whole = tf.ensure_shape(restored_tensors[_VALUE], self.shape)
    values = tf.split(whole,
                      [int(s.shape[self.axis]) for s in self.shards],
                      axis=self.axis)
    ops = [shard.assign(value) for shard, value in zip(self.shards, values)]
    # A sharded slot's shard (ZeRO-1) assigns through a function that
    # returns nothing.
    ops = [op for op in ops if op is not None]
    return tf.group(ops) if ops and not tf.executing_eagerly() else None

  def numpy(self):
    """The full value (shards concatenated)."""
    return np.concatenate([np.asarray(s.numpy()) for s in self.shards],
                          axis=self.axis)

  def assign(self, value):
    """Sets the shards from the full value."""
    value = np.asarray(value)
    for shard, piece in zip(self.shards, np.split(value, len(self.shards),
                                                  axis=self.axis)):
      shard.assign(piece)


def dense_product(x, kernel, transpose_kernel=False):
  """`x @ kernel` over x's last axis, for x of any rank >= 2.

  The leading axes are folded into one and the product is one MatMul,
  whose gradients are MatMuls too. Not `tf.einsum("...i,io->...o")`: its
  gradient for the kernel (TF 2.21 `_EinsumGrad`) gives the kernel the
  ellipsis ("...o,...i->io...") and computes the outer product [i, o,
  *leading] before summing the leading axes away: for the GPT at width
  128 on 2 shards (batch 16 x 64 tokens), 128 x 256 x 1024 floats (128
  MiB) for one MLP Dense. That made the split 30-70x slower than the
  unsplit model (issue 36: 4.9 against 219 examples/s at model:2).
  """
  if x.shape.rank == 2:
    return tf.matmul(x, kernel, transpose_b=transpose_kernel)
  units = kernel.shape[0 if transpose_kernel else 1]
  flat = tf.reshape(x, [-1, x.shape[-1]])
  y = tf.matmul(flat, kernel, transpose_b=transpose_kernel)
  y = tf.reshape(y, tf.concat([tf.shape(x)[:-1], [units]], 0))
  y.set_shape(x.shape[:-1].concatenate([units]))
  return y


def _cut_weights(layer, name, shape, axis, devices, initializer):
  """D variables of `shape` with `shape[axis]` cut D ways, shard d on
  devices[d], and the `ShardedWeight` over them."""
  shard_shape = list(shape)
  shard_shape[axis] //= len(devices)
  shards = []
  for d, device in enumerate(devices):
    with tf.device(device):
      shards.append(layer.add_weight(shape=tuple(shard_shape),
                                     initializer=initializer,
                                     name=f"{name}_shard_{d}"))
  return shards, ShardedWeight(shards, axis)


def _cut_by_shard(specs, devices):
  """As `_cut_weights` for several weights, made shard by shard, each
  shard's as a Keras Dense's would be (`<layer path>/shard_<d>/<name>`).
  The caller tracks them (assigns them to the layer) in that order.

  Args:
    specs: [(name, shape, axis, initializer)].
  Returns:
    [(shards, ShardedWeight)], one per spec.
  """
  cut = [[] for _ in specs]
  for d, device in enumerate(devices):
    # Made by a layer of the shard's name (not kept): the variables' paths.
    part = keras.layers.Layer(name=f"shard_{d}")
    with tf.device(device):
      for shards, (name, shape, axis, initializer) in zip(cut, specs):
        shard_shape = list(shape)
        shard_shape[axis] //= len(devices)
        shards.append(part.add_weight(shape=tuple(shard_shape),
                                      initializer=initializer, name=name))
  return [(shards, ShardedWeight(shards, spec[2]))
          for shards, spec in zip(cut, specs)]


class ShardPart(CheckpointNode):
  """One device's part of a column- or row-parallel layer, callable as a
  layer of a device-pinned `Stage` (`fn(x)`, its variables); checkpointed
  as a Dense layer with `weights` (name -> variable) would be.

  Args:
    fn: `x -> y`, the part's math (e.g. `layer.shard(d, .)`).
    weights: {name: variable} of the part, in order.
    units: its output units.
    dtype: the compute dtype (the input is cast to it, as a Keras layer
      does).

  It has no symbolic `input`: a stage of parts counts no activations
  (`Stage.activation_bytes`), as the Dense shards' stages never did.
  """

  def __init__(self, fn, weights, units, dtype):
    self.fn = fn
    self.named_weights = dict(weights)
    self.units = units
    self.dtype = dtype
    self.kernel = self.named_weights.get("kernel")
    self.bias = self.named_weights.get("bias")

  def __call__(self, x, training=False):
    del training  # no dropout or statistics in a matmul and a bias
    return self.fn(tf.cast(x, self.dtype))

  @property
  def trainable_variables(self):
    return list(self.named_weights.values())

  weights = trainable_variables
  non_trainable_variables = ()

  def get_weights(self):
    return [np.asarray(v.numpy()) for v in self.weights]

  def set_weights(self, values):
    for variable, value in zip(self.weights, values):
      variable.assign(value)

  def _trackable_children(self, save_type="checkpoint", **kwargs):
    return dict(self.named_weights)


class ColumnParallelLinear(keras.layers.Layer):
  """A Dense cut by output units: shard d has `units / D` of them.

  `shard(d, x)` is `activation(x W[:, d] + b[d])` (run it on devices[d]);
  `call(x)` the list of the D shards' outputs `[.., units / D]`, shard d
  computed on devices[d]; `shards[d]` shard d as a layer of its own (a
  `ShardPart`, for a device-pinned stage).
  """

  # Weights made shard by shard under `shard_<d>/` (`ColumnParallelDense`)
  # instead of all kernel shards, then all bias shards.
  by_shard = False

  def __init__(self, units, devices, activation=None, **kwargs):
    super().__init__(**kwargs)
    self.devices = tuple(devices)
    check_positive("units", units)
    check_divides(len(self.devices), **{f"{self.name} units": units})
    self.units = units
    self.activation = keras.activations.get(activation)

  def build(self, input_shape):
    inputs = int(input_shape[-1])
    specs = [("kernel", (inputs, self.units), 1, "glorot_uniform"),
             ("bias", (self.units,), 0, "zeros")]
    if self.by_shard:
      cut = _cut_by_shard(specs, self.devices)
      # Tracked shard by shard: the layer's variable order.
      self.shard_weights = [v for pair in zip(cut[0][0], cut[1][0])
                            for v in pair]
    else:
      cut = [_cut_weights(self, *spec[:3], self.devices, spec[3])
             for spec in specs]
    (self.kernel_shards, self._kernel), (self.bias_shards, self.bias) = cut

  @property
  def kernel(self):
    """The whole kernel, as its shards (a `ShardedWeight`)."""
    return self._kernel

  @functools.cached_property  # one object per part: checkpoint nodes
  def shards(self):
    """Shard d as a layer (`ShardPart`): `shard(d, .)` and its weights."""
    size = self.units // len(self.devices)
    return [ShardPart(lambda x, d=d: self.shard(d, x),
                      {"kernel": self.kernel_shards[d],
                       "bias": self.bias_shards[d]}, size,
                      self.compute_dtype)
            for d in range(len(self.devices))]

  def shard(self, d, x):
    kernel = tf.cast(self.kernel_shards[d], x.dtype)
    y = dense_product(x, kernel)
    return self.activation(y + tf.cast(self.bias_shards[d], x.dtype))

  def call(self, x):
    outputs = []
    for d, device in enumerate(self.devices):
      with tf.device(device):
        outputs.append(self.shard(d, x))
    return outputs


class RowParallelLinear(keras.layers.Layer):
  """A Dense cut by input units: shard d holds rows `d * k/D ...`.

  `partial(d, x_d)` is shard d's partial product (on devices[d]);
  `add_bias(s)` the bias (and `activation`) added to their sum, on every
  device for a summed copy there (the bias one variable, on
  `output_device`, default devices[0]). `call(xs)` takes the D shards'
  inputs and sums the partial products on `output_device`; `shards[d]`
  and `output_layer` are those pieces as layers (`ShardPart`s).
  """

  by_shard = False  # as `ColumnParallelLinear.by_shard`

  def __init__(self, units, devices, activation=None, output_device=None,
               **kwargs):
    super().__init__(**kwargs)
    self.devices = tuple(devices)
    check_positive("units", units)
    self.units = units
    self.activation = keras.activations.get(activation)
    self.output_device = output_device or self.devices[0]

  def build(self, input_shape):
    inputs = int(input_shape[-1])
    check_divides(len(self.devices), **{f"{self.name} inputs": inputs})
    spec = ("kernel", (inputs, self.units), 0, "glorot_uniform")
    if self.by_shard:
      [(self.kernel_shards, self._kernel)] = _cut_by_shard(
          [spec], self.devices)
      with tf.device(self.output_device):
        # A Dense pair's bias layer's path (`<layer path>/bias/bias`).
        self.bias = keras.layers.Layer(name="bias").add_weight(
            shape=(self.units,), initializer="zeros", name="bias")
      return
    self.kernel_shards, self._kernel = _cut_weights(
        self, *spec[:3], self.devices, spec[3])
    with tf.device(self.output_device):
      self.bias = self.add_weight(shape=(self.units,), initializer="zeros",
                                  name="bias")

  @property
  def kernel(self):
    """The whole kernel, as its shards (a `ShardedWeight`)."""
    return self._kernel

  @functools.cached_property  # one object per part: checkpoint nodes
  def shards(self):
    """Shard d's partial product as a layer (`ShardPart`)."""
    return [ShardPart(lambda x, d=d: self.partial(d, x),
                      {"kernel": self.kernel_shards[d]}, self.units,
                      self.compute_dtype)
            for d in range(len(self.devices))]

  @functools.cached_property
  def output_layer(self):
    """`add_bias` as a layer (`ShardPart`), on `output_device`."""
    return ShardPart(self.add_bias, {"bias": self.bias}, self.units,
                     self.compute_dtype)

  def partial(self, d, x):
    kernel = tf.cast(self.kernel_shards[d], x.dtype)
    return dense_product(x, kernel)

  def add_bias(self, summed):
    return self.activation(summed + tf.cast(self.bias, summed.dtype))

  def call(self, inputs):
    partials = []
    for d, (device, x) in enumerate(zip(self.devices, inputs)):
      with tf.device(device):
        partials.append(self.partial(d, x))
    with tf.device(self.output_device):
      return self.add_bias(tf.add_n(partials))


class VocabParallelEmbedding(keras.layers.Layer):
  """A token table [V, W] cut by vocabulary, and its reverse (the head).

  Shard d holds ids `d * V/D ... (d+1) * V/D - 1`. `lookup(d, ids)` is the
  embedding of the ids in that range and zeros for the others (their sum
  over shards is the full lookup); `logits(d, x)` shard d's logits
  [.., V/D], through the same table (tied) or a kernel [W, V] cut by
  columns.
  """

  def __init__(self, vocab_size, width, devices, tied=True, **kwargs):
    super().__init__(**kwargs)
    self.devices = tuple(devices)
    check_divides(len(self.devices), vocab_size=vocab_size)
    self.vocab_size, self.width, self.tied = vocab_size, width, tied
    self.shard_size = vocab_size // len(self.devices)

  def build(self, input_shape=None):
    init = keras.initializers.RandomNormal(stddev=0.02)
    self.table_shards, self.embeddings = _cut_weights(
        self, "embeddings", (self.vocab_size, self.width), 0, self.devices,
        init)
    if not self.tied:
      self.reverse_shards, self.reverse_kernel = _cut_weights(
          self, "reverse_kernel", (self.width, self.vocab_size), 1,
          self.devices, init)

  def lookup(self, d, ids):
    ids = tf.cast(ids, tf.int32) - d * self.shard_size
    inside = (ids >= 0) & (ids < self.shard_size)
    rows = tf.gather(self.table_shards[d],
                     tf.where(inside, ids, tf.zeros_like(ids)))
    return rows * tf.cast(inside, rows.dtype)[..., tf.newaxis]

  def logits(self, d, x):
    if self.tied:
      return dense_product(x, tf.cast(self.table_shards[d], x.dtype),
                           transpose_kernel=True)
    return dense_product(x, tf.cast(self.reverse_shards[d], x.dtype))


def _shard_statistics(d, logits, labels, shard_size):
  """(log-sum-exp, the label's logit or 0, max, arg-max) of shard d, per
  token; the label's logit only where the label is in shard d's range."""
  logits = tf.cast(logits, tf.float32)
  local = tf.cast(labels, tf.int32) - d * shard_size
  inside = (local >= 0) & (local < shard_size)
  picked = tf.gather(logits, tf.where(inside, local, tf.zeros_like(local)),
                     batch_dims=labels.shape.rank)
  target = tf.where(inside, picked, tf.zeros_like(picked))
  best = tf.stop_gradient(tf.reduce_max(logits, axis=-1))
  index = tf.argmax(logits, axis=-1, output_type=tf.int32) + d * shard_size
  return tf.reduce_logsumexp(logits, axis=-1), target, best, index


def shard_devices(tensors):
  """The short device names of `tensors` (as placed by `on_device`)."""
  return tuple(short_device(t.device) for t in tensors)


def vocab_parallel_statistics(logit_shards, labels, devices=None):
  """(per-token cross-entropy, per-token 1.0/0.0 arg-max == label), both on
  devices[0], from logit shards [.., V/D] (shard d on devices[d]).

  Each shard reduces its own logits to per-token log-sum-exp, label logit,
  max and arg-max; only those 4 values per token and shard are exchanged
  (one all-gather), never the logits: loss = logsumexp_d(lse_d) -
  sum_d target_d.
  """
  devices = tuple(devices or shard_devices(logit_shards))
  shard_size = int(logit_shards[0].shape[-1])

  def pack(d, logits):
    lse, target, best, index = _shard_statistics(d, logits, labels,
                                                 shard_size)
    # Ids are exact in float32 up to 2**24.
    return tf.stack([lse, target, best, tf.cast(index, tf.float32)], axis=-1)

  packed = [on_device(device, lambda x, d=d: pack(d, x), logits)
            for d, (logits, device) in enumerate(zip(logit_shards, devices))]
  gathered = all_gather(packed, devices)[0]  # [D, .., 4]
  with tf.device(devices[0]):
    lse, target, best, index = tf.unstack(gathered, axis=-1)
    loss = (tf.reduce_logsumexp(lse, axis=0) - tf.reduce_sum(target, axis=0))
    # The first shard holding the maximum wins, as tf.argmax over the full
    # logits picks the first maximum.
    winner = tf.one_hot(tf.argmax(tf.stop_gradient(best), axis=0),
                        len(devices), axis=0, dtype=tf.float32)
    predicted = tf.reduce_sum(tf.stop_gradient(index) * winner, axis=0)
    correct = tf.cast(tf.equal(tf.cast(predicted, tf.int32),
                               tf.cast(labels, tf.int32)), tf.float32)
  return loss, correct


def vocab_parallel_cross_entropy(logit_shards, labels, devices=None):
  """Per-token softmax cross-entropy of logit shards (see
  `vocab_parallel_statistics`), on devices[0]."""
  return vocab_parallel_statistics(logit_shards, labels, devices)[0]


def sharded_sparse_categorical_loss(labels, logits):
  """A Trainer `loss_fn`: the vocab-parallel cross-entropy of a list of
  logit shards, the usual sparse cross-entropy of a plain tensor."""
  if isinstance(logits, (list, tuple)):
    return vocab_parallel_cross_entropy(logits, labels)
  return keras.losses.sparse_categorical_crossentropy(
      labels, tf.cast(logits, tf.float32), from_logits=True)


# Model name -> `split(model, devices)` (a model package registers its own:
# framework code never imports models/).
def _is_variable(value):
  return isinstance(value, (keras.Variable, tf.Variable))


def _is_list(value):
  """A list the optimizer tracks (Keras wraps lists for checkpoints)."""
  return (not _is_variable(value) and not hasattr(value, "keys") and
          hasattr(value, "__iter__") and hasattr(value, "__len__"))


def _shadow(optimizer, variables):
  """An optimizer of `optimizer`'s kind and settings built on `variables`:
  the layout an unsplit run's optimizer has (only its structure is read).
  Its learning rate is a variable exactly where `optimizer`'s is (a
  schedule is not one), so that the flat variable lists line up."""
  rate = (0.0 if _tf_internal.learning_rate_variable(optimizer) is not None
          else keras.optimizers.schedules.ExponentialDecay(0.0, 1, 1.0))
  shadow = type(optimizer).from_config(dict(optimizer.get_config(),
                                            learning_rate=rate))
  shadow.build(list(variables))
  return shadow


def unsplit_view(optimizer, unsplit_variables, split_weights, *,
                 state=None, index=None):
  """The checkpoint view of a split model's built `optimizer`.

  Args:
    optimizer: the optimizer built on the split model's trainable
      variables.
    unsplit_variables: the unsplit model's trainable variables, in the
      order an unsplit run builds its optimizer on.
    split_weights: for each of them, the split model's weight: a variable,
      or a `ShardedWeight` over its shard variables.
    state, index: where the optimizer's state is checkpointed from, if not
      `optimizer` itself: a view with its children (the data axis's ZeRO-1
      view, `optimizer_sharding`, whose slots save whole), and `index(variable)`,
      a split variable's position in its per-variable lists.

  Returns:
    A trackable to checkpoint as `optimizer`.

  Raises:
    ValueError: the optimizer's state does not line up with the weights.
  """
  unsplit_variables = list(unsplit_variables)
  split_weights = list(split_weights)
  if len(split_weights) != len(unsplit_variables):
    raise ValueError(f"{len(split_weights)} split weights for "
                     f"{len(unsplit_variables)} unsplit variables")
  split_count = sum(len(w.shards) if isinstance(w, ShardedWeight) else 1
                    for w in split_weights)
  shadow = _shadow(optimizer, unsplit_variables)
  mine = _tf_internal.trackable_children(
      optimizer if state is None else state)
  theirs = _tf_internal.trackable_children(shadow)
  if index is None:
    index = lambda v: _tf_internal.optimizer_variable_index(optimizer, v)

  def piece(values, weight):
    if isinstance(weight, ShardedWeight):
      return ShardedWeight([values[index(s)] for s in weight.shards],
                           weight.axis)
    return values[index(weight)]

  # id(a shadow variable) -> what the view saves in its place.
  found = {}
  children = {}
  for name, child in theirs.items():
    own = mine.get(name)
    if _is_variable(child):
      if own is None:
        raise ValueError(f"the split optimizer has no {name}")
      found[id(child)] = children[name] = own
    elif (_is_list(child) and len(child) == len(unsplit_variables)
          and own is not None and len(own) == split_count):
      entries = []
      for value, variable, weight in zip(child, unsplit_variables,
                                         split_weights):
        # The variables themselves (the list they were built on), or a
        # per-variable slot.
        entry = weight if value is variable else piece(own, weight)
        found[id(value)] = entry
        entries.append(entry)
      children[name] = _Node(entries)
  for name, child in theirs.items():
    if name in children:
      continue
    if _is_list(child):
      missing = [getattr(v, "path", v) for v in child if id(v) not in found]
      if missing:
        raise ValueError(f"optimizer state {missing[:3]} has no counterpart "
                         "in the split optimizer")
      children[name] = _Node([found[id(v)] for v in child])
    else:  # e.g. Keras's dict of variable indices (no variables in it)
      children[name] = mine.get(name, child)
  # The shadow's order: a checkpoint keys each value by its first path.
  return _Node({name: children[name] for name in theirs})


def checkpoint_mirror(obj, replace):
  """`obj`'s checkpoint tree (e.g. an unsplit model's) with each variable
  whose id is in `replace` swapped for its value there (a split's variable
  or `ShardedWeight`): a checkpoint of it has `obj`'s keys."""
  memo = {}

  def mirror(node):
    if _is_variable(node):
      return replace.get(id(node), node)
    if id(node) not in memo:
      memo[id(node)] = _Node({})
      memo[id(node)].children = {
          name: mirror(child) for name, child in
          _tf_internal.trackable_children(node).items()}
    return memo[id(node)]

  return mirror(obj)


class _Node(CheckpointNode):
  """A checkpoint node with the given children, in order (a list's are
  named `0`, `1`, ..., as Keras's tracked lists name theirs)."""

  def __init__(self, children):
    if not hasattr(children, "keys"):
      children = {str(i): child for i, child in enumerate(children)}
    self.children = dict(children)

  def _trackable_children(self, save_type="checkpoint", **kwargs):
    return dict(self.children)
