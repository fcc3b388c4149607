"""Every private TensorFlow / Keras API in framework/_tf_internal.py still
works on the pinned versions: an upgrade that moves one fails here, naming
it, instead of deep inside a run."""

import ast
import inspect
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from framework import _tf_internal
from framework.check import distribution_randomness

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_optimizer_slots_and_weight_decay():
  kernel = keras.Variable(np.ones((2, 2), np.float32), name="kernel")
  bias = keras.Variable(np.zeros(2, np.float32), name="bias")
  optimizer = keras.optimizers.AdamW(weight_decay=0.1)
  optimizer.exclude_from_weight_decay(var_names=["bias"])
  optimizer.build([kernel, bias])
  assert _tf_internal.optimizer_variable_index(optimizer, bias) == 1
  m, v = _tf_internal.adam_slots(optimizer, 1)
  assert tuple(m.shape) == tuple(v.shape) == (2,) and m is not v
  assert _tf_internal.uses_weight_decay(optimizer, kernel)
  assert not _tf_internal.uses_weight_decay(optimizer, bias)


def test_parameter_server_strategy_counts_its_workers():
  # Set when it connects, which needs a live cluster: checked in source.
  source = inspect.getsource(
      tf.distribute.experimental.ParameterServerStrategy._connect_to_cluster)  # pylint: disable=protected-access
  assert "self._num_workers = " in source


def test_collective_all_reduce_parts():
  keys = _tf_internal.collective_keys()
  reducer = _tf_internal.collective_all_reduce(["/cpu:0", "/cpu:1"], keys)
  assert isinstance(reducer, tf.distribute.CrossDeviceOps)
  values = _tf_internal.per_replica([tf.constant(1.0), tf.constant(2.0)])
  assert isinstance(values, tf.distribute.DistributedValues)
  assert len(values.values) == 2


def test_control_input_and_graph_function():
  @tf.function
  def inner(x):
    return x + 1

  found = {}

  @tf.function
  def outer(x):
    first = tf.identity(x, name="first")
    second = tf.identity(x, name="second")
    _tf_internal.add_control_input(second.op, first.op)
    found["control"] = list(second.op.control_inputs)
    graph = tf.compat.v1.get_default_graph()
    call = inner(x).op
    while call.type not in ("PartitionedCall", "StatefulPartitionedCall"):
      call = call.inputs[0].op
    found["function"] = _tf_internal.graph_function(
        graph, call.get_attr("f").name)
    return second

  outer(tf.constant(1.0))
  assert [op.name for op in found["control"]] == ["first"]
  assert found["function"] is not None and hasattr(found["function"], "graph")


def test_functional_model_internals():
  inner = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4)])
  inputs = keras.Input((3,))
  model = keras.Model(inputs, keras.layers.Dense(2)(inner(inputs)))
  by_depth = _tf_internal.nodes_by_depth(model)
  assert sorted(by_depth) == [0, 1, 2]
  assert _tf_internal.inbound_nodes(model.layers[-1])[0].operation is (
      model.layers[-1])
  assert {type(l).__name__ for l in _tf_internal.flatten_layers(model)} == {
      "InputLayer", "Sequential", "Dense"}  # the nested Dense too
  assert len(_tf_internal.flatten_layers(model)) == 5
  variable = model.layers[-1].kernel
  with tf.device("/cpu:1"):
    _tf_internal.initialize_variable(variable, tf.zeros(variable.shape))
  assert not np.any(variable.numpy())
  assert variable.value.device.endswith("CPU:1")


def test_random_op_modules_have_the_wrapped_ops():
  for (module, name) in distribution_randomness._NEUTRAL:  # pylint: disable=protected-access
    assert callable(getattr(module, name)), name
  with pytest.raises(ValueError, match="not one of"):
    _tf_internal.random_op_module("gen_math_ops")


def test_coordination_service_parts():
  from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2  # pylint: disable=g-import-not-at-top
  from tensorflow.python.distribute import multi_worker_util  # pylint: disable=g-import-not-at-top
  from tensorflow.python.eager import context  # pylint: disable=g-import-not-at-top
  assert coordination_config_pb2.CoordinatedJob(name="worker", num_tasks=2)
  assert callable(multi_worker_util.coordination_leader)
  assert callable(context.context().configure_coordination_service)
  assert _tf_internal.coordination_service_configured() is False


def test_no_other_module_uses_tensorflow_or_keras_internals():
  offenders = []
  for folder, _, files in os.walk(os.path.join(ROOT, "framework")):
    for name in files:
      path = os.path.join(folder, name)
      if not name.endswith(".py") or name == "_tf_internal.py":
        continue
      tree = ast.parse(open(path).read())
      for node in ast.walk(tree):
        module = (node.module if isinstance(node, ast.ImportFrom) else
                  node.names[0].name if isinstance(node, ast.Import) else "")
        if (module or "").startswith(("tensorflow.python", "keras.src",
                                      "tensorflow.compiler")):
          offenders.append(f"{os.path.relpath(path, ROOT)}: {module}")
  assert not offenders
