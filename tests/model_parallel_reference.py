"""Unsplit references for the model-parallel tests (not a test module)."""

import keras
import numpy as np
import tensorflow as tf

import framework
import framework.core.trainer  # noqa: F401  (the attribute chain below)
import models

STRATEGY = tf.distribute.get_strategy()  # one replica, as model parallelism
DEVICES = ["/CPU:0", "/CPU:1"]  # conftest's logical CPU devices


def build(name, input_shape, num_classes, seed=1, **options):
  """The same initial weights every call with the same seed."""
  keras.utils.set_random_seed(seed)
  return models.build_model(name, input_shape, num_classes, **options)


def data(batch, input_shape, num_classes, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(batch, *input_shape)).astype(np.float32)
  y = rng.integers(0, num_classes, size=batch).astype(np.int32)
  return x, y


def batches(x, y):
  """An iterator repeating one global batch."""
  return iter(tf.data.Dataset.from_tensors((x, y)).repeat())


def unsplit_gradients(model, x, y, global_batch_size, num_microbatches=1):
  """(gradients, loss) of the unsplit model, summed over micro-batches."""
  variables = model.trainable_variables
  tapes, losses = [], []
  for xs, ys in zip(tf.split(x, num_microbatches),
                    tf.split(y, num_microbatches)):
    with tf.GradientTape() as tape:
      per_example = framework.core.trainer.sparse_categorical_loss(
          ys, model(xs, training=True))
      if per_example.shape.rank > 1:  # per pixel: each example's mean
        per_example = tf.reduce_mean(
            tf.reshape(per_example, [tf.shape(per_example)[0], -1]), 1)
      loss = tf.nn.compute_average_loss(per_example,
                                        global_batch_size=global_batch_size)
    tapes.append(tape)
    losses.append(loss)
  # Summed last micro-batch first, as GPipe's backward pass does: float sums
  # in another order differ in the last bits, which Adam can amplify for
  # near-zero gradients.
  total_grads = None
  for tape, loss in reversed(list(zip(tapes, losses))):
    grads = tape.gradient(loss, variables)
    total_grads = grads if total_grads is None else [
        a + b for a, b in zip(total_grads, grads)]
  return total_grads, tf.add_n(losses)


class MicroBatchedTrainer(framework.Trainer):
  """The unsplit model on one device, gradients summed over micro-batches.

  With BatchNorm the statistics are per micro-batch, so this (not the
  full-batch Trainer) is the unsplit equivalent of a micro-batched pipeline;
  with num_microbatches=1 it is the plain Trainer.
  """

  def __init__(self, *args, num_microbatches=1, **kwargs):
    super().__init__(*args, **kwargs)
    self.num_microbatches = num_microbatches

  def train_step(self, batch):
    grads, loss = unsplit_gradients(self.model, *batch,
                                    self.global_batch_size,
                                    self.num_microbatches)
    grads, norm = self.clip_by_global_norm(grads)
    self.apply_gradients(grads)
    return {"loss": loss, "grad_norm": norm}


def assert_close(actual, expected, what, atol=1e-5):
  actual, expected = np.asarray(actual), np.asarray(expected)
  assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
  error = float(np.max(np.abs(actual - expected))) if actual.size else 0.0
  assert error <= atol, f"{what}: max |difference| {error:.3g} > {atol}"


def skip_model(input_dim=6, num_classes=4, units=8, seed=1):
  """Functional: a -> b -> c -> add(c, a) -> out; cut before `c`, the skip
  from `a` crosses the cut."""
  keras.utils.set_random_seed(seed)
  inputs = keras.Input((input_dim,))
  a = keras.layers.Dense(units, activation="tanh", name="a")(inputs)
  b = keras.layers.Dense(units, activation="tanh", name="b")(a)
  c = keras.layers.Dense(units, activation="tanh", name="c")(b)
  joined = keras.layers.Add(name="join")([c, a])
  outputs = keras.layers.Dense(num_classes, name="out")(joined)
  return keras.Model(inputs, outputs, name="skip")
