"""Pieces of a model pinned to one device, forward AND backward.

`tf.GradientTape` does not put gradient ops next to their forward ops: they
land wherever the `tape.gradient` call happens (device 0 by default). So each
piece records its forward pass on its own tape, under its own device, and
computes its backward pass from that tape under the same device:

    forward:  x_i   = identity(x)                 # receive on device i
              y     = layers_i(x_i)               # recorded on tape_i
    backward: dx_i, dW_i = tape_i.gradient(y, [x_i, W_i], dy)   # on device i

A `Stage` is a run of layers on one device (a pipeline stage); a
`ParallelStage` is several stages on different devices that read the same
input and whose outputs are summed (tensor parallelism). Ops are named
`<stage name>/...` (backward: `gradient_tape/<stage name>/...`) so that tests
can find every op of a piece in the traced graph.

Recomputation (`recompute=True`, GPipe's re-materialisation): the forward
pass keeps no tape, only the piece's input (and a copy of its layers' state:
BatchNorm statistics, dropout seed counters); the backward pass re-runs the
forward on a fresh tape from that input and state, then takes the gradient.
The state is put back afterwards, so the step updates BatchNorm statistics
and draws dropout masks exactly as without recomputation.
"""

import collections

import numpy as np
import tensorflow as tf

# What a forward pass keeps for its backward pass. With recomputation:
# tape None, `state` the layers' state before the pass, `head` the loss.
Record = collections.namedtuple(
    "Record", ["tape", "inputs", "target", "state", "head", "training"],
    defaults=(None, None, True))


def state_variables(layers):
  """The non-trainable variables of `layers` (BatchNorm stats, seeds)."""
  seen, variables = set(), []
  for layer in layers:
    for v in getattr(layer, "non_trainable_variables", ()):
      if id(v) not in seen:
        seen.add(id(v))
        variables.append(v)
  return variables


def read_state(variables):
  """The current values of `variables` (read in program order)."""
  return [tf.identity(v.value) for v in variables]


class restored_state:  # pylint: disable=invalid-name
  """Sets `variables` to `values` inside the block, then back as they were.

  The recomputed forward pass then sees the state of the original pass
  (same dropout masks) and leaves no trace in it (no second BatchNorm
  update). Variable ops run in program order inside a `tf.function`.
  """

  def __init__(self, variables, values):
    self.variables, self.values = variables, values

  def __enter__(self):
    self.current = read_state(self.variables)
    for v, value in zip(self.variables, self.values):
      v.assign(value)

  def __exit__(self, *exc):
    for v, value in zip(self.variables, self.current):
      v.assign(value)


def tensor_bytes(tensor):
  """Bytes per example of a symbolic (Keras) tensor: shape[1:] x dtype."""
  return int(np.prod(tensor.shape[1:])) * tf.as_dtype(tensor.dtype).size


class Stage:
  """`layers` run in order on `device`.

  Args:
    name: a name scope for the ops (e.g. `stage_1`).
    device: e.g. `/CPU:1` or `/GPU:1`.
    layers: callables (Keras layers) applied in order.
  """

  def __init__(self, name, device, layers):
    self.name = name
    self.device = device
    self.layers = list(layers)

  @property
  def trainable_variables(self):
    return [v for layer in self.layers for v in layer.trainable_variables]

  @property
  def leaves(self):
    """The single-device stages this stage consists of: itself."""
    return [self]

  def _call(self, x, training):
    for layer in self.layers:
      x = layer(x, training=training)
    return x

  def apply(self, x, training=False):
    """The forward pass on `device`, not recorded (evaluation)."""
    with tf.device(self.device), tf.name_scope(self.name + "/"):
      return self._call(tf.identity(x), training)

  def forward(self, x, training=True, head=None, after=(), recompute=False):
    """(outputs, record): the forward pass on `device`, recorded.

    Args:
      x: the input (from another device, or the batch).
      training: passed to the layers.
      head: optional `outputs -> scalar` (the loss) computed on this device
        and on this tape; `record.target` is then that scalar.
      after: tensors that must exist before this pass starts (the device's
        previous work: one micro-batch at a time).
      recompute: keep only `x` (and the layers' state); `backward` runs
        the forward pass again.
    """
    with tf.device(self.device), tf.name_scope(self.name + "/"):
      # One copy onto this device, instead of one per consuming op. Only
      # this op waits for `after`: control inputs on the layers' ops would
      # stop Grappler from fusing them (and change the float results).
      with tf.control_dependencies(after):
        x = tf.identity(x)
      if recompute:
        state = read_state(state_variables(self.layers))
        outputs = self._call(x, training)
        target = head(outputs) if head is not None else outputs
        return outputs, Record(None, x, target, state, head, training)
      with tf.GradientTape() as tape:
        tape.watch(x)
        outputs = self._call(x, training)
        target = head(outputs) if head is not None else outputs
    return outputs, Record(tape, x, target)

  def backward(self, record, output_grad, input_grad=True, after=()):
    """(d input, [d variable]) on `device`, from the forward `record`.

    Args:
      record: what `forward` returned.
      output_grad: d loss / d outputs (None when the target is the loss).
      input_grad: False skips d input (the first stage's input is data).
      after: tensors that must exist before this pass starts.
    """
    variables = self.trainable_variables
    with tf.device(self.device), tf.name_scope(self.name + "/"):
      if output_grad is None:
        output_grad = tf.ones_like(record.target)  # d loss / d loss
      with tf.control_dependencies(after):
        output_grad = tf.identity(output_grad)
      if record.tape is None:
        record = self._recompute(record, output_grad)
      sources = ([record.inputs] if input_grad else []) + variables
      grads = record.tape.gradient(
          record.target, sources, output_gradients=output_grad,
          unconnected_gradients=tf.UnconnectedGradients.ZERO)
    if not input_grad:
      return None, grads
    return grads[0], grads[1:]

  def _recompute(self, record, output_grad):
    """The record `forward` would have kept, by running it again."""
    # Waiting for the output gradient starts the recomputation in the
    # backward pass (and keeps Grappler from merging it with the forward).
    with tf.control_dependencies([output_grad]):
      x = tf.identity(record.inputs)
    with restored_state(state_variables(self.layers), record.state):
      with tf.GradientTape() as tape:
        tape.watch(x)
        outputs = self._call(x, record.training)
        target = record.head(outputs) if record.head is not None else outputs
    return Record(tape, x, target)

  def activation_bytes(self, recompute=False):
    """Bytes per example this stage keeps for its backward pass.

    From the static shapes: its input and every layer's output (with
    `recompute`: its input only). None if a layer was never called on a
    symbolic input, or the stage has no Keras layers (a tensor shard).
    """
    if not self.layers:
      return None
    try:
      tensors = [self.layers[0].input] + (
          [] if recompute else [layer.output for layer in self.layers])
    except (AttributeError, ValueError):
      return None
    return sum(tensor_bytes(t) for t in tf.nest.flatten(tensors))


class ParallelStage:
  """Stages on several devices that share one input; outputs are summed.

  The sum (and the sum of the input gradients) runs on `device`, where the
  next stage reads it.
  """

  def __init__(self, name, device, branches):
    self.name = name
    self.device = device
    self.branches = list(branches)

  @property
  def trainable_variables(self):
    return [v for branch in self.branches for v in branch.trainable_variables]

  @property
  def leaves(self):
    return list(self.branches)

  def _sum(self, tensors, what):
    with tf.device(self.device), tf.name_scope(f"{self.name}/{what}/"):
      return tf.add_n(tensors)

  def apply(self, x, training=False):
    return self._sum([b.apply(x, training) for b in self.branches], "sum")

  def forward(self, x, training=True, head=None, after=(), recompute=False):
    if head is not None:
      raise ValueError("a ParallelStage cannot compute the loss; end the "
                       "model with a Stage")
    outputs, records = zip(*(b.forward(x, training, after=after,
                                       recompute=recompute)
                             for b in self.branches))
    return self._sum(list(outputs), "sum"), records

  def backward(self, records, output_grad, input_grad=True, after=()):
    # The gradient of a sum is the same output_grad for every branch.
    input_grads, variable_grads = [], []
    for branch, record in zip(self.branches, records):
      dx, grads = branch.backward(record, output_grad, input_grad, after)
      input_grads.append(dx)
      variable_grads.extend(grads)
    if not input_grad:
      return None, variable_grads
    return self._sum(input_grads, "sum_input_grads"), variable_grads
