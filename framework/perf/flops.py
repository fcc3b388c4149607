"""Counting FLOPs and measuring the machine's matmul peak (for MFU).

    MFU = training FLOPs per example x examples/s / peak FLOP/s

FLOPs are counted from the traced graph of one training step (forward, loss
and backward; the optimizer's element-wise update is negligible and not
counted), and cross-checked with an analytic count of the conv and dense
layers, or for a transformer by nanoGPT's closed form
(`transformer_flops_per_token`). The peak is a matmul timed on this machine
in the run's compute dtype (`framework.perf.peak` keeps it per host).
"""

import time

import keras
import numpy as np
import tensorflow as tf


def _elements(tensor):
  return int(np.prod(tensor.shape.as_list()))


# Ops that run another function's graph (a loop's body as many times as it
# iterates): the matmuls inside are not in the outer graph's op list.
_CALLS_A_FUNCTION = frozenset((
    "While", "StatelessWhile", "If", "StatelessIf", "Case", "StatelessCase",
    "PartitionedCall", "StatefulPartitionedCall", "For", "RemoteCall"))


def graph_matmul_flops(concrete_function, outer_ops_only=False):
  """2 x multiply-adds of the conv and matmul ops in a traced graph.

  Counted op by op from the static shapes: Conv2D and its two gradients
  (each 2 x output-gradient elements x kernel height x width x input
  channels) and MatMul (2 x output elements x inner dimension).
  TF's profiler counts a conv gradient over the conv's *input* size, which
  overcounts 'valid' convolutions; this count is exact.

  Args:
    concrete_function: the traced function.
    outer_ops_only: count the outer graph's ops even where it runs a loop,
      a conditional or a nested function (a lower bound, for ranking).

  Raises:
    ValueError: the graph runs a loop, a conditional or a nested function
      (an RNN's `While`) and not `outer_ops_only`: its FLOPs cannot be
      counted from its ops alone.
  """
  graph = concrete_function.graph
  returned = {t.ref() for t in graph.outputs}
  total = 0
  for op in graph.get_operations():
    if op.type in _CALLS_A_FUNCTION and not outer_ops_only:
      raise ValueError(f"the graph runs a {op.type} op ({op.name}), whose "
                       "iterations and branches are not counted")
    if op.type not in ("Conv2D", "Conv2DBackpropInput",
                       "Conv2DBackpropFilter", "MatMul"):
      continue
    if not (op.outputs[0].consumers() or op.outputs[0].ref() in returned):
      continue  # e.g. the unused input gradient of the first layer: pruned
    if op.type in ("Conv2D", "Conv2DBackpropInput", "Conv2DBackpropFilter"):
      kernel = (op.outputs[0] if op.type == "Conv2DBackpropFilter"
                else op.inputs[1]).shape.as_list()
      out = op.outputs[0] if op.type == "Conv2D" else op.inputs[2]
      total += 2 * _elements(out) * kernel[0] * kernel[1] * kernel[2]
    elif op.type == "MatMul":
      a = op.inputs[0].shape.as_list()
      inner = a[0] if op.get_attr("transpose_a") else a[1]
      total += 2 * _elements(op.outputs[0]) * inner
  return total


def call_training_flops(fn, specs, variables, input_gradient=True,
                        outer_ops_only=False):
  """Conv + matmul FLOPs of `fn(*inputs)`'s forward and backward pass.

  Traces (never runs) `fn` on inputs of `specs` under a tape and its
  gradient with respect to `variables` (and the floating inputs when
  `input_gradient`), then counts with `graph_matmul_flops`: a layer's share
  of a training step, counted alone.

  Args:
    fn: `(*tensors) -> outputs` (a layer call).
    specs: a list of `tf.TensorSpec`, one per argument.
    variables: the trainable variables `fn` reads.
    input_gradient: also differentiate with respect to the inputs (every
      layer but the first in a model needs it).
    outer_ops_only: as in `graph_matmul_flops`.
  """

  @tf.function(autograph=False)
  def step(*inputs):
    floating = [t for t in inputs if t.dtype.is_floating]
    with tf.GradientTape() as tape:
      tape.watch(floating)
      outputs = [tf.cast(o, tf.float32) for o in tf.nest.flatten(fn(*inputs))]
    sources = (floating if input_gradient else []) + list(variables)
    return tape.gradient(outputs, sources,
                         unconnected_gradients=tf.UnconnectedGradients.ZERO)

  return graph_matmul_flops(step.get_concrete_function(*specs),
                            outer_ops_only)


def graph_flops(concrete_function):
  """All float operations of a traced `tf.function`, per TF's profiler."""
  options = tf.compat.v1.profiler.ProfileOptionBuilder.float_operation()
  options["output"] = "none"
  profile = tf.compat.v1.profiler.profile(graph=concrete_function.graph,
                                          options=options)
  return profile.total_float_ops


def training_flops_per_example(model, input_shape, batch_size=8):
  """FLOPs per example of forward + backward, counted in the traced graph.

  Returns:
    {"matmul": conv + matmul FLOPs (what MFU counts), "all": every op TF's
     profiler has a FLOP count for (element-wise ops included)}.
  """
  variables = model.trainable_variables

  @tf.function
  def step(images, labels):
    with tf.GradientTape() as tape:
      logits = tf.cast(model(images, training=True), tf.float32)
      loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
          labels, logits, from_logits=True))
    return tape.gradient(loss, variables)

  concrete = step.get_concrete_function(
      tf.TensorSpec([batch_size, *input_shape], tf.float32),
      tf.TensorSpec([batch_size], tf.int32))
  return {"matmul": graph_matmul_flops(concrete) / batch_size,
          "all": graph_flops(concrete) / batch_size}


def _layer_macs(layer):
  """Multiply-adds per example of a Conv2D or Dense layer's forward pass."""
  if isinstance(layer, keras.layers.Conv2D):
    out = layer.output.shape  # [batch, h, w, filters]
    kh, kw = layer.kernel_size
    return out[1] * out[2] * out[3] * kh * kw * layer.input.shape[-1]
  return layer.input.shape[-1] * layer.units


def analytic_flops_per_example(model):
  """2 x multiply-adds of conv/dense layers: forward, and x3 for training.

  Training = forward + gradient w.r.t. inputs + gradient w.r.t. weights; a
  layer that no trainable layer precedes needs no input gradient.
  """
  forward, no_input_grad, trainable_before = 0, 0, False
  for layer in model.layers:
    if not isinstance(layer, (keras.layers.Conv2D, keras.layers.Dense)):
      trainable_before |= bool(layer.trainable_weights)
      continue
    macs = _layer_macs(layer)
    forward += 2 * macs
    if not trainable_before:
      no_input_grad += 2 * macs
    trainable_before = True
  return {"forward": forward, "training": 3 * forward - no_input_grad}


def layer_kernel_times(model, batch_size, calls=10):
  """Each conv/dense layer's forward + backward, timed alone.

  A layer runs on random inputs of its real shape, with its real kernels
  (TF fuses bias and activation as in the model), and nothing else runs:
  no BatchNorm, pooling, dropout, loss or optimizer. Summed over layers, this
  is what a step of `model` costs with TensorFlow's kernels on this machine
  if every other op were free (less only where layers' kernels overlap), so
  FLOPs / that time is the MFU ceiling of any training loop.

  Returns:
    [{"layer", "input_shape", "input_gradient", "flops", "ms"}] per layer
    (FLOPs for the batch; ms the median of `calls` timed calls).
  """
  rng = np.random.default_rng(0)
  rows, trainable_before = [], False
  for layer in model.layers:
    if not isinstance(layer, (keras.layers.Conv2D, keras.layers.Dense)):
      trainable_before |= bool(layer.trainable_weights)
      continue
    # Same rule as the analytic count: the first trainable layer needs no
    # input gradient.
    input_gradient, trainable_before = trainable_before, True
    # In the layer's compute dtype (bfloat16 under mixed precision), as the
    # model's own activations and output gradients are.
    x, dy = (tf.constant(rng.standard_normal(
        (batch_size, *shape[1:])).astype(np.float32), dtype=layer.compute_dtype)
             for shape in (layer.input.shape, layer.output.shape))

    @tf.function
    def step(x, dy, layer=layer, input_gradient=input_gradient):
      with tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(x)
      sources = ([x] if input_gradient else []) + layer.trainable_variables
      return tape.gradient(y, sources, output_gradients=dy)

    for _ in range(2):
      [g.numpy() for g in step(x, dy)]  # trace and warm up
    times = []
    for _ in range(calls):
      start = time.perf_counter()
      [g.numpy() for g in step(x, dy)]
      times.append(time.perf_counter() - start)
    passes = 3 if input_gradient else 2  # forward, weight (, input) grads
    rows.append({"layer": layer.name,
                 "input_shape": [batch_size, *layer.input.shape[1:]],
                 "input_gradient": input_gradient,
                 "flops": 2 * _layer_macs(layer) * batch_size * passes,
                 "ms": 1000 * float(np.median(times))})
  return rows


def matmul_peak_flops(size=2048, repeats=4, trials=3,
                      compute_dtype="float32", device=None):
  """Best measured matmul FLOP/s ([size, size] @ [size, size]) in
  `compute_dtype`, on `device` (a TF device name; None: TensorFlow's default
  placement)."""
  with tf.device(device):
    a = tf.cast(tf.constant(np.random.default_rng(0).standard_normal(
        (size, size)).astype(np.float32)), compute_dtype)
    scale = tf.constant(1.0 / size, compute_dtype)

    @tf.function
    def chain(x):
      for _ in range(repeats):
        x = tf.matmul(x, a) * scale  # keep values bounded
      return x

    chain(a).numpy()  # trace and warm up
    best = float("inf")
    for _ in range(trials):
      start = time.perf_counter()
      chain(a).numpy()
      best = min(best, time.perf_counter() - start)
  return 2.0 * size**3 * repeats / best


def model_flops_per_example(model, input_shape, input_dtype="float32",
                            batch_size=2):
  """Conv + matmul FLOPs per example of a training step of `model`: its
  forward pass and the gradient of its outputs w.r.t. its trainable
  variables, counted in the traced (never run) graph (`graph_matmul_flops`).
  The loss adds no conv or matmul, so this is `training_flops_per_example`'s
  "matmul" for any output shape (per-pixel logits too)."""
  spec = tf.TensorSpec([batch_size, *input_shape], input_dtype)
  return call_training_flops(model, [spec], model.trainable_variables,
                             input_gradient=False) / batch_size


def transformer_flops_per_token(num_params, num_layers, width,
                                sequence_length):
  """Training FLOPs per token of a decoder transformer (nanoGPT's
  `estimate_mfu`, from PaLM's appendix B): 6 N for the weights' forward
  and backward matmuls plus 12 L H Q T for attention (H Q = `width`).

  Args:
    num_params: N, the weights a token's matmuls read (no position table;
      an untied output head in, an untied token table, a lookup, out).
    num_layers: L blocks; `width`: the model width; `sequence_length`: T.
  """
  return 6 * num_params + 12 * num_layers * width * sequence_length
