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
from framework.check import distribution_step

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


def test_optimizer_children_and_a_value_saved_as_a_variable(tmp_path):
  kernel = keras.Variable(np.ones((2, 2), np.float32), name="kernel")
  optimizer = keras.optimizers.Adam()
  optimizer.build([kernel])
  children = _tf_internal.trackable_children(optimizer)
  assert {"_variables", "_trainable_variables", "_iterations",
          "_momentums", "_velocities"} <= set(children)
  assert list(children["_momentums"])[0] is _tf_internal.adam_slots(
      optimizer, 0)[0]
  # Saved under a variable's key: a variable restores it, and back.
  restored = []
  saved = _tf_internal.SavedAsVariable(
      save=lambda: tf.constant([1.0, 2.0]), restore=restored.append)
  path = tf.train.Checkpoint(v=saved).write(str(tmp_path / "a"))
  variable = tf.Variable([0.0, 0.0])
  tf.train.Checkpoint(v=variable).read(path).assert_consumed()
  assert variable.numpy().tolist() == [1.0, 2.0]
  path = tf.train.Checkpoint(v=tf.Variable([3.0, 4.0])).write(
      str(tmp_path / "b"))
  tf.train.Checkpoint(v=saved).read(path).assert_consumed()
  assert restored[0].numpy().tolist() == [3.0, 4.0]


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
  assert _tf_internal.has_layer_graph(model)
  assert not _tf_internal.has_layer_graph(_Subclassed())
  assert "training" in _tf_internal.call_context_args(
      keras.layers.Dropout(0.5))
  assert _tf_internal.call_context_args(keras.ops.add) == ()


class _Subclassed(keras.Model):

  def call(self, x):
    return x


def test_learning_rate_variable_and_seed_generator_state():
  optimizer = keras.optimizers.SGD(0.1)
  variable = _tf_internal.learning_rate_variable(optimizer)
  assert hasattr(variable, "assign") and float(variable.numpy()) == (
      pytest.approx(0.1))
  scheduled = keras.optimizers.SGD(
      keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5))
  assert _tf_internal.learning_rate_variable(scheduled) is None
  dropout = keras.Sequential([keras.Input((3,)), keras.layers.Dropout(0.5),
                              keras.layers.BatchNormalization()])
  states = [v for v in dropout.non_trainable_variables
            if _tf_internal.is_seed_generator_state(v)]
  assert len(states) == 1 and len(dropout.non_trainable_variables) == 3


def test_optimizer_slots_alone_and_a_shared_step_counter():
  kernel = keras.Variable(np.ones((2, 2), np.float32), name="kernel")
  first, second = keras.optimizers.Adam(0.1), keras.optimizers.Adam(0.1)
  first.build([kernel])
  _tf_internal.share_step_counter(second, first.iterations)
  second.build([kernel])
  assert second.iterations is first.iterations
  slots = _tf_internal.optimizer_slot_variables(second)
  assert len(slots) == 2 and len(second.variables) == 4
  assert all(v is not second.iterations for v in slots)
  first.iterations.assign(5)
  assert int(second.iterations.numpy()) == 5


def test_an_unbuilt_optimizer_builds_again_as_if_new(tmp_path):
  """Built over one model, unbuilt and built over two: the variables and
  checkpoint keys of one built over both in the first place."""
  first = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
  second = keras.Sequential([keras.Input((2,)), keras.layers.Dense(4)])
  both = first.trainable_variables + second.trainable_variables
  rebuilt, fresh = keras.optimizers.Adam(0.1), keras.optimizers.Adam(0.1)
  rebuilt.build(first.trainable_variables)
  _tf_internal.unbuild_optimizer(rebuilt)
  rebuilt.build(both)
  fresh.build(both)
  assert [v.name for v in rebuilt.variables] == [
      v.name for v in fresh.variables]
  assert len(rebuilt.variables) == 2 + 2 * 4

  def keys(optimizer, name):
    path = tf.train.Checkpoint(optimizer=optimizer).save(
        str(tmp_path / name))
    return sorted(tf.train.list_variables(path))

  assert keys(rebuilt, "rebuilt") == keys(fresh, "fresh")
  rebuilt.apply_gradients([(tf.ones_like(v), v) for v in both])
  assert int(rebuilt.iterations.numpy()) == 1


def test_random_layers_have_a_seed_generator():
  assert _tf_internal.has_seed_generator(keras.layers.Dropout(0.5))
  assert _tf_internal.has_seed_generator(keras.layers.RandomFlip())
  assert not _tf_internal.has_seed_generator(keras.layers.Dense(2))


def test_onednn_query():
  assert _tf_internal.onednn_enabled() in (True, False)


def test_random_op_modules_have_the_wrapped_ops():
  for (module, name) in distribution_step._NEUTRAL:  # pylint: disable=protected-access
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


_INTERNAL_MODULES = ("tensorflow.python", "keras.src", "tensorflow.compiler")
# The names TensorFlow and Keras are imported as: a private attribute read
# off them (`tf.distribute._x`, `tf.__internal__`) is an internal.
_TF_NAMES = ("tf", "tensorflow", "keras")
# The builtins (and object's methods) that reach an attribute by its name.
_BY_NAME = ("getattr", "hasattr", "setattr", "delattr", "__getattribute__",
            "__setattr__", "__delattr__")
# Keras/TensorFlow-internal names that a string literal must not match
# elsewhere: variable names, attribute names and checkpoint keys by
# convention (not the preprocessing layers' `generator`: too common a word),
# and Keras's name for an optimizer's step counter (read
# `optimizer.iterations` instead).
_INTERNAL_STRINGS = (_tf_internal.SEED_GENERATOR_STATE, "seed_generator",
                     _tf_internal.VARIABLE_VALUE_KEY, "iteration")


def _private(name):
  return name.startswith("_") and not (
      name.startswith("__") and name.endswith("__") and name != "__internal__")


def _root(node):
  while isinstance(node, ast.Attribute):
    node = node.value
  return node.id if isinstance(node, ast.Name) else None


def _by_string(node):
  """`what` when `node` reads a private attribute through a string: a
  `getattr`-like builtin on anything but `self`/`cls`, or `attrgetter`."""
  if not isinstance(node, ast.Call):
    return None
  func = node.func
  name = func.id if isinstance(func, ast.Name) else (
      func.attr if isinstance(func, ast.Attribute) else None)
  if name in _BY_NAME and len(node.args) >= 2:
    owner, attribute = node.args[0], node.args[1]
    if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
      return None  # distloop's own attributes
    strings = [attribute]
  elif name == "attrgetter":
    strings = node.args
  else:
    return None
  for arg in strings:
    if (isinstance(arg, ast.Constant) and isinstance(arg.value, str)
        and any(_private(part) for part in arg.value.split("."))):
      return f"{name}(..., {arg.value!r})"
  return None


def internal_uses(source):
  """[(line, what)] of `source`'s uses of TensorFlow/Keras internals: an
  internal module imported, a private attribute read by a string
  (`getattr(x, "_name")`) or off `tf`/`keras`, or a Keras-internal name."""
  found = []
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, (ast.Import, ast.ImportFrom)):
      modules = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                 else [alias.name for alias in node.names])
      found += [(node.lineno, f"import {m}") for m in modules
                if m.startswith(_INTERNAL_MODULES)]
    elif _by_string(node):
      found.append((node.lineno, _by_string(node)))
    elif (isinstance(node, ast.Attribute) and _private(node.attr)
          and _root(node) in _TF_NAMES):
      found.append((node.lineno, f"{_root(node)}...{node.attr}"))
    elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
          and node.value in _INTERNAL_STRINGS):
      found.append((node.lineno, repr(node.value)))
  return found


def test_the_scan_finds_each_kind_of_use():
  source = ("from tensorflow.python.util import x\n"
            "import keras.src.layers\n"
            "a = getattr(layer, '_call_context_args', ())\n"
            "b = hasattr(model, '_nodes_by_depth')\n"
            "c = getattr(module, '__file__', None)\n"  # dunder: public
            "d = getattr(layer, 'trainable_variables', [])\n"
            "e = [v for v in vs if v.name == 'seed_generator_state']\n"
            "f = getattr(self, '_replica_step', None)\n"  # distloop's own
            "g = operator.attrgetter('optimizer._learning_rate')(t)\n"
            "h = tf.distribute.Strategy._extended\n"
            "i = tf.__internal__.tracking.Trackable\n"
            "j = getattr(l, 'seed_generator', None)\n"
            "k = attribute.name == 'VARIABLE_VALUE'\n"
            "m = [v for v in opt.variables if v.name != 'iteration']\n"
            "n = self._trainer.model\n"  # not off tf or keras
            "setattr(obj, '_private', 1)\n"
            "object.__setattr__(optimizer, '_iterations', counter)\n"
            "object.__setattr__(self, 'mode', mode)\n")
  assert sorted(line for line, _ in internal_uses(source)) == [
      1, 2, 3, 4, 7, 9, 10, 11, 12, 13, 14, 16, 17]


def test_no_other_module_uses_tensorflow_or_keras_internals():
  offenders = []
  for top in ("framework", "models", "scripts"):
    for folder, _, files in os.walk(os.path.join(ROOT, top)):
      for name in files:
        path = os.path.join(folder, name)
        if not name.endswith(".py") or path == os.path.join(
            ROOT, "framework", "_tf_internal.py"):
          continue
        with open(path) as f:
          offenders += [f"{os.path.relpath(path, ROOT)}:{line}: {what}"
                        for line, what in internal_uses(f.read())]
  assert not offenders, "go through framework/_tf_internal.py:\n" + (
      "\n".join(offenders))


def test_preemption_handler_has_its_peer_watcher_stop():
  source = inspect.getsource(
      tf.distribute.experimental.PreemptionCheckpointHandler)
  assert "def _stop_cluster_wise_termination_watcher_thread" in source


def test_checkpoint_object_graph_names_each_value(tmp_path):
  model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
  prefix = tf.train.Checkpoint(model=model).write(str(tmp_path / "ckpt"))
  graph = _tf_internal.checkpoint_object_graph(tf.train.load_checkpoint(
      prefix))
  keys = {a.checkpoint_key for node in graph.nodes for a in node.attributes
          if a.name == "VARIABLE_VALUE"}
  assert keys == {name for name, _ in tf.train.list_variables(prefix)
                  if name.endswith("VARIABLE_VALUE")}
