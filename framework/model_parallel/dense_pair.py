"""Tensor parallelism: one hidden layer's units split across D devices.

For the pair `h = act(x W1 + b1)`, `y = act2(h W2 + b2)` with W1 [n, H] and
W2 [H, k], cut the H hidden units into D shards of H/D:

    column-parallel (device d):  h_d = act(x W1[:, d] + b1[d])      [B, H/D]
    row-parallel    (device d):  p_d = h_d W2[d, :]                 [B, k]
    output device:               y   = act2(sum_d p_d + b2)

`h` is never gathered: shard d's units only feed shard d's rows of W2, and
the partial products are summed. This equals the unsplit pair exactly (up to
the order of a float sum), e.g. a hidden layer of 10 units as 5 + 5.
"""

import keras
import numpy as np
import tensorflow as tf

from framework.errors import ConfigError, check_positive
from framework.model_parallel.pipeline import model_layers


class BiasActivation(keras.layers.Layer):
  """`activation(x + bias)`: what is left of a Dense after its matmul."""

  def __init__(self, activation=None, **kwargs):
    super().__init__(**kwargs)
    self.activation = keras.activations.get(activation)

  def build(self, input_shape):
    self.bias = self.add_weight(shape=(input_shape[-1],), name="bias",
                                initializer="zeros")

  def call(self, x):
    return self.activation(x + self.bias)


class ColumnParallelDense(keras.layers.Layer):
  """A Dense whose output units are split across `devices`.

  `call(x)` returns the list of D shards `[B, units / D]`, shard d computed
  on devices[d] with the variables that live there.
  """

  def __init__(self, units, devices, activation=None, **kwargs):
    super().__init__(**kwargs)
    check_positive("units", units)
    if units % len(devices):
      raise ConfigError(f"a Dense layer of {units} units cannot be split "
                        f"evenly across {len(devices)} devices")
    self.units = units
    self.devices = list(devices)
    self.shards = []
    for d, device in enumerate(self.devices):
      with tf.device(device):
        self.shards.append(keras.layers.Dense(
            units // len(devices), activation=activation, name=f"shard_{d}"))

  def build(self, input_shape):
    for shard, device in zip(self.shards, self.devices):
      with tf.device(device):
        shard.build(input_shape)

  def call(self, x):
    outputs = []
    for shard, device in zip(self.shards, self.devices):
      with tf.device(device):
        outputs.append(shard(x))
    return outputs


class RowParallelDense(keras.layers.Layer):
  """A Dense whose input units arrive as shards, one per device.

  Shard d's partial product `h_d W[d]` runs on devices[d]; the sum, bias and
  activation run on `output_device`.
  """

  def __init__(self, units, devices, activation=None, output_device=None,
               **kwargs):
    super().__init__(**kwargs)
    self.units = units
    self.devices = list(devices)
    self.output_device = output_device or self.devices[0]
    self.shards = []
    for d, device in enumerate(self.devices):
      with tf.device(device):
        self.shards.append(keras.layers.Dense(units, use_bias=False,
                                              name=f"shard_{d}"))
    with tf.device(self.output_device):
      self.output_layer = BiasActivation(activation, name="bias")

  def build(self, input_shapes):
    for shard, device, shape in zip(self.shards, self.devices, input_shapes):
      with tf.device(device):
        shard.build(shape)
    with tf.device(self.output_device):
      self.output_layer.build((None, self.units))

  def call(self, inputs):
    partials = []
    for shard, device, x in zip(self.shards, self.devices, inputs):
      with tf.device(device):
        partials.append(shard(x))
    with tf.device(self.output_device):
      return self.output_layer(tf.add_n(partials))


class TensorParallelModel(keras.Model):
  """`before` layers, a column/row-parallel pair, `after` layers."""

  def __init__(self, before, column, row, after, device, **kwargs):
    super().__init__(**kwargs)
    self.before = list(before)
    self.column = column
    self.row = row
    self.after = list(after)
    self.host_device = device

  def call(self, x, training=False):
    with tf.device(self.host_device):
      for layer in self.before:
        x = layer(x, training=training)
    x = self.row(self.column(x))
    with tf.device(self.host_device):
      for layer in self.after:
        x = layer(x, training=training)
    return x


def _is_dense(layer):
  return type(layer) is keras.layers.Dense  # pylint: disable=unidiomatic-typecheck


def default_split_layer(layers):
  """The last Dense layer directly followed by a Dense layer (or None)."""
  candidates = [i for i in range(len(layers) - 1)
                if _is_dense(layers[i]) and _is_dense(layers[i + 1])]
  return candidates[-1] if candidates else None


def check_split_layer(layers, index, num_shards):
  """Raises ConfigError unless layers[index] can be split num_shards ways."""
  names = ", ".join(f"{i}:{type(l).__name__}" for i, l in enumerate(layers))
  if index is None:
    raise ConfigError(
        "tensor parallelism needs a Dense layer followed directly by a Dense "
        f"layer (a Dropout in between cannot be split; disable it, e.g. "
        "--nodropout); the "
        f"model's layers are {names}")
  if not 0 <= index < len(layers) - 1:
    raise ConfigError(f"split_layer={index} must be a layer index in "
                      f"0..{len(layers) - 2} (layers: {names})")
  layer, consumer = layers[index], layers[index + 1]
  if not (_is_dense(layer) and _is_dense(consumer)):
    raise ConfigError(
        f"split_layer={index} ({type(layer).__name__} followed by "
        f"{type(consumer).__name__}) cannot be split: it must be a Dense "
        f"layer followed directly by a Dense layer (layers: {names})")
  if layer.units % num_shards:
    raise ConfigError(
        f"split_layer={index} has {layer.units} units, which cannot be split "
        f"evenly across num_shards={num_shards}")
  return index


def split_dense_pair(model, index, devices):
  """A `TensorParallelModel` equal to `model` with layers[index] split.

  layers[index] becomes column-parallel and layers[index + 1] row-parallel
  over `devices`; the other layers stay on devices[0]. The weights are the
  model's, sliced.
  """
  layers = model_layers(model)
  check_split_layer(layers, index, len(devices))
  dense, consumer = layers[index], layers[index + 1]
  host = devices[0]
  kernel, bias = dense.get_weights()
  consumer_kernel, consumer_bias = consumer.get_weights()
  shard_units = dense.units // len(devices)
  cuts = [slice(d * shard_units, (d + 1) * shard_units)
          for d in range(len(devices))]

  def copy(layer):
    return type(layer).from_config(layer.get_config())

  with keras.name_scope(model.name):
    with tf.device(host):
      before = [copy(layer) for layer in layers[:index]]
      after = [copy(layer) for layer in layers[index + 2:]]
    column = ColumnParallelDense(dense.units, devices,
                                 activation=dense.activation, name=dense.name)
    row = RowParallelDense(consumer.units, devices,
                           activation=consumer.activation,
                           output_device=host, name=consumer.name)
    placed = TensorParallelModel(before, column, row, after, host,
                                 name=model.name)
    # Build eagerly, piece by piece: a device scope inside a symbolic call
    # does not reach the variables Keras creates there.
    x = keras.Input(shape=model.input_shape[1:])
    with tf.device(host):
      for layer in before:
        x = layer(x)
    column.build(x.shape)
    row.build([(None, shard_units)] * len(devices))
    y = keras.Input(shape=(consumer.units,))
    with tf.device(host):
      for layer in after:
        y = layer(y)
    placed(keras.Input(shape=model.input_shape[1:]))  # all built: no new vars
  for old, new in zip(layers[:index] + layers[index + 2:], before + after):
    new.set_weights(old.get_weights())
  for d, cut in enumerate(cuts):
    column.shards[d].set_weights([kernel[:, cut], bias[cut]])
    row.shards[d].set_weights([consumer_kernel[cut, :]])
  row.output_layer.set_weights([consumer_bias])
  return placed


def merge_dense_pair(placed, model, index):
  """Writes the weights of `placed` (see `split_dense_pair`) into `model`."""
  layers = model_layers(model)
  column, row = placed.column, placed.row
  for old, new in zip(layers[:index] + layers[index + 2:],
                      placed.before + placed.after):
    old.set_weights(new.get_weights())
  kernels, biases = zip(*(shard.get_weights() for shard in column.shards))
  layers[index].set_weights([np.concatenate(kernels, axis=1),
                             np.concatenate(biases)])
  row_kernels = [shard.get_weights()[0] for shard in row.shards]
  layers[index + 1].set_weights([np.concatenate(row_kernels, axis=0),
                                 row.output_layer.get_weights()[0]])
  return model
