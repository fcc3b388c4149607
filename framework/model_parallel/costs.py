"""What each layer costs, for choosing a pipeline's cut points.

A pipeline runs at the pace of its slowest stage, so stages should get equal
WORK, not equal parameters: a big Dense after the convolutions holds most of
a CNN's parameters and little of its compute. `flops` (the default) counts
each layer's forward + backward conv/matmul FLOPs per example, from its own
traced graph (`perf.flops.call_training_flops`: the layer traced alone on
its input shapes; nothing is run); `params` counts its parameters.

FLOPs leave out element-wise layers (BatchNorm, activations, pooling, adds),
which then cost nothing; cut points are chosen by the conv/matmul work.
A layer that cannot be traced alone counts 0 (logged). Without any FLOPs
(no conv or matmul anywhere) the split falls back to parameter counts.
"""

from absl import logging
import keras
import tensorflow as tf

from framework import _tf_internal
from framework.model_parallel.choices import BALANCES  # pylint: disable=unused-import
from framework.model_parallel.split_config import SplitConfig
from framework.settings import default
from framework.perf.flops import call_training_flops


def count_params(layer):
  """Parameters of a built Keras layer (0 for other operations)."""
  return layer.count_params() if isinstance(
      layer, keras.layers.Layer) and layer.built else 0


def call_layer(layer, args, kwargs, training):
  """`layer(*args, **kwargs)`, with `training` if the layer takes it."""
  # As keras.Model's call: `training` only for layers that take it.
  if "training" in _tf_internal.call_context_args(layer):
    kwargs = dict(kwargs, training=training)
  return layer(*args, **kwargs)


def _spec(tensor):
  return tf.TensorSpec([1, *tensor.shape[1:]], tensor.dtype)


def node_flops(node, input_gradient=True):
  """Training FLOPs per example of one Keras call node, traced alone."""
  layer = node.operation
  inputs = list(node.input_tensors)

  def fn(*tensors):
    args, kwargs = node.arguments.fill_in(
        {id(k): t for k, t in zip(inputs, tensors)})
    return call_layer(layer, args, kwargs, training=True)

  return call_training_flops(fn, [_spec(t) for t in inputs],
                             getattr(layer, "trainable_variables", []),
                             input_gradient)


def node_costs(nodes, balance=default(SplitConfig, "stage_balance")):
  """Per-node cost (`flops` or `params`) of a model's call nodes, in order.

  A node with no trainable layer before it (in this order) needs no input
  gradient (as in the pipeline, whose first stage computes none).
  """
  params = [count_params(node.operation) for node in nodes]
  if balance == "params":
    return params
  costs, trainable_before = [], False
  for node in nodes:
    try:
      costs.append(node_flops(node, input_gradient=trainable_before))
    except Exception as e:  # pylint: disable=broad-except
      logging.warning("stage_balance=flops: cannot trace layer %r alone "
                      "(%s); counting it as 0 FLOPs",
                      node.operation.name, e)
      costs.append(0)
    trainable_before |= bool(getattr(node.operation, "trainable_variables",
                                     None))
  if not any(costs):
    logging.warning("stage_balance=flops: no conv/matmul FLOPs counted; "
                    "balancing by parameter count")
    return params
  return costs


def layer_costs(layers, balance=default(SplitConfig, "stage_balance")):
  """Per-layer cost of a built `keras.Sequential`'s layers, in order."""
  # Keras 3: a layer's node 0 is its call in the Sequential's functional
  # graph (built on an Input).
  return node_costs([_tf_internal.inbound_nodes(layer)[0] for layer in layers],
                    balance)
