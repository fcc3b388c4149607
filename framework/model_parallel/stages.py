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
"""

import collections

import tensorflow as tf

# What a forward pass keeps for its backward pass.
Record = collections.namedtuple("Record", ["tape", "inputs", "target"])


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

  def forward(self, x, training=True, head=None, after=()):
    """(outputs, record): the forward pass on `device`, recorded.

    Args:
      x: the input (from another device, or the batch).
      training: passed to the layers.
      head: optional `outputs -> scalar` (the loss) computed on this device
        and on this tape; `record.target` is then that scalar.
      after: tensors that must exist before this pass starts (the device's
        previous work: one micro-batch at a time).
    """
    with tf.device(self.device), tf.name_scope(self.name + "/"):
      # One copy onto this device, instead of one per consuming op. Only
      # this op waits for `after`: control inputs on the layers' ops would
      # stop Grappler from fusing them (and change the float results).
      with tf.control_dependencies(after):
        x = tf.identity(x)
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
    sources = ([record.inputs] if input_grad else []) + variables
    with tf.device(self.device), tf.name_scope(self.name + "/"):
      if output_grad is None:
        output_grad = tf.ones_like(record.target)  # d loss / d loss
      with tf.control_dependencies(after):
        output_grad = tf.identity(output_grad)
      grads = record.tape.gradient(
          record.target, sources, output_gradients=output_grad,
          unconnected_gradients=tf.UnconnectedGradients.ZERO)
    if not input_grad:
      return None, grads
    return grads[0], grads[1:]


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

  def forward(self, x, training=True, head=None, after=()):
    if head is not None:
      raise ValueError("a ParallelStage cannot compute the loss; end the "
                       "model with a Stage")
    outputs, records = zip(*(b.forward(x, training, after=after)
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
