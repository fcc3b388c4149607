"""Counting FLOPs and measuring the machine's matmul peak (for MFU).

    MFU = training FLOPs per example x examples/s / peak FLOP/s

FLOPs are counted from the traced graph of one training step (forward, loss
and backward; the optimizer's element-wise update is negligible and not
counted), and cross-checked with an analytic count of the conv and dense
layers. The peak is a float32 matmul timed on this machine in the same run.
"""

import time

import keras
import numpy as np
import tensorflow as tf


def graph_flops(concrete_function):
  """Float operations of one call of a traced `tf.function` (TF's profiler)."""
  options = tf.compat.v1.profiler.ProfileOptionBuilder.float_operation()
  options["output"] = "none"
  profile = tf.compat.v1.profiler.profile(graph=concrete_function.graph,
                                          options=options)
  return profile.total_float_ops


def training_flops_per_example(model, input_shape, batch_size=8):
  """Graph-counted FLOPs of forward + backward per example for `model`."""
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
  return graph_flops(concrete) / batch_size


def analytic_flops_per_example(model):
  """2 x multiply-adds of conv/dense layers: forward, and x3 for training.

  Training = forward + gradient w.r.t. inputs + gradient w.r.t. weights; the
  first layer with weights needs no input gradient.
  """
  forward, first = 0, None
  for layer in model.layers:
    if isinstance(layer, keras.layers.Conv2D):
      out = layer.output.shape  # [batch, h, w, filters]
      kh, kw = layer.kernel_size
      macs = out[1] * out[2] * out[3] * kh * kw * layer.input.shape[-1]
    elif isinstance(layer, keras.layers.Dense):
      macs = layer.input.shape[-1] * layer.units
    else:
      continue
    forward += 2 * macs
    first = 2 * macs if first is None else first
  return {"forward": forward, "training": 3 * forward - first}


def matmul_peak_flops(size=2048, repeats=4, trials=3):
  """Best measured float32 matmul FLOP/s ([size, size] @ [size, size])."""
  a = tf.constant(np.random.default_rng(0).standard_normal(
      (size, size)).astype(np.float32))

  @tf.function
  def chain(x):
    for _ in range(repeats):
      x = tf.matmul(x, a) * (1.0 / size)  # keep values bounded
    return x

  chain(a).numpy()  # trace and warm up
  best = float("inf")
  for _ in range(trials):
    start = time.perf_counter()
    chain(a).numpy()
    best = min(best, time.perf_counter() - start)
  return 2.0 * size**3 * repeats / best
