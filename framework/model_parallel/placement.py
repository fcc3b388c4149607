"""Checks where the ops of a traced step actually asked to run.

Device scopes are easy to get wrong silently (an unplaced op runs on device 0
and the step is still correct, only slower and bigger). `misplaced_ops`
reads the traced graph: every op named under a piece's name scope (forward
`stage_1/...`, backward `gradient_tape/stage_1/...`) must carry that piece's
device.
"""

import re

from framework import _tf_internal
from framework.model_parallel.devices import short_device

_CALL_OPS = ("PartitionedCall", "StatefulPartitionedCall")


def _operations(graph):
  """All ops of `graph`, including those of functions it calls."""
  for op in graph.get_operations():
    yield op
    if op.type in _CALL_OPS:
      function = _tf_internal.graph_function(graph, op.get_attr("f").name)
      if function is not None and hasattr(function, "graph"):
        yield from _operations(function.graph)


def ops_by_scope(graph, scopes):
  """`{scope: [op, ...]}`: the ops named under each scope (any nesting)."""
  found = {scope: [] for scope in scopes}
  for op in _operations(graph):
    for scope in scopes:
      # A re-entered relative scope becomes `stage_1_1/`: match it too.
      if re.search(rf"(^|/){re.escape(scope)}(_\d+)?/", op.name):
        found[scope].append(op)
  return found


def _captured_devices(graph):
  """`{placeholder name: device}` of the variables a function captured."""
  devices = {}
  for external, internal in getattr(graph, "captures", []):
    device = getattr(external, "device", "")
    if device:
      devices[internal.op.name] = device
  return devices


def effective_device(op, captured):
  """The device `op` asked for, or (reads of a variable) its variable's.

  Variable reads are created without a device on purpose (TensorFlow's
  `colocate_with(None, ignore_existing=True)`): the placer has to run them
  where the variable lives, so that is their device.
  """
  if op.device:
    return op.device
  if op.name in captured:
    return captured[op.name]
  if op.type == "ReadVariableOp" and op.inputs[0].op.name in captured:
    return captured[op.inputs[0].op.name]
  return ""


def _handle(variable):
  variable = getattr(variable, "value", variable)  # Keras -> tf.Variable
  return variable.handle


def misplaced_ops(graph, devices_by_scope, shared_variables=()):
  """Ops under a scope whose requested device is not that scope's device.

  Args:
    graph: a traced graph, e.g. `tf.function(step).get_concrete_function(
      ...).graph`.
    devices_by_scope: `{"stage_0": "/CPU:0", "stage_1": "/CPU:1"}`.
    shared_variables: variables every piece may read where they live (e.g.
      the optimizer's step counter).
  Returns:
    A list of `"op_name (type) on 'device', expected 'device'"` strings.
  """
  captured = _captured_devices(graph)
  shared_handles = {id(_handle(v)) for v in shared_variables}
  shared = {internal.op.name for external, internal in
            getattr(graph, "captures", []) if id(external) in shared_handles}
  offenders = []
  for scope, ops in ops_by_scope(graph, devices_by_scope).items():
    expected = devices_by_scope[scope]
    for op in ops:
      if op.name in shared or (op.type == "ReadVariableOp" and
                               op.inputs[0].op.name in shared):
        continue
      device = effective_device(op, captured)
      if short_device(device) != expected:
        offenders.append(f"{op.name} ({op.type}) on {device!r}, expected "
                         f"{expected!r}")
  return offenders
