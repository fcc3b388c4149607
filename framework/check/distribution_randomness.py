"""Random ops in the distribution check: found, and drawn at their mean.

A stochastic train step cannot draw the same numbers on N replicas as on one
device: each replica draws a tensor shaped like its own part of the batch,
from its own op (stateful ops) or its own counter (stateless ops), so no
seeding makes replica k's draw equal to rows k·B/N.. of the one-device draw.
A correct step with input noise then differs from the reference by the noise
itself, which the check would blame on the step.

So while the check traces its steps (both sides), every random op that
TensorFlow's Python API creates is replaced by a constant at the centre of
its distribution, the same for every example whatever the split:

    normal, truncated normal (stateful, stateless, tf.random.Generator)  0
    uniform on [0, 1), before tf.random.uniform scales it to [lo, hi)  0.5

The step is then deterministic, so the check compares everything around the
random draws exactly (a wrong divisor next to the noise still shows), and
reports the replaced ops as a warning: what the random values themselves do
is not compared. Any op left drawing (integer, categorical, shuffle, gamma,
Poisson, binomial draws, or ops created without going through TensorFlow's
Python wrappers) is found in the traced graph and named too: differences
caused by it can be mistaken for a bug.

Limits: the replacement happens only while the check traces (graph mode),
in this process; a hand-written dropout whose keep test fails at 0.5 (rate
> 0.5) drops every unit during the check, so what lies below it is not
compared. Keras noise layers are switched off instead (see
`distribution_layers`), so they never reach these ops.
"""

import contextlib
import inspect
import os
import re
import sysconfig
import threading
import traceback

import tensorflow as tf

from framework import _tf_internal

# The generated op wrappers: TensorFlow's own random functions call them
# through these modules, so replacing a module attribute replaces the op.
gen_random_ops = _tf_internal.random_op_module("gen_random_ops")
gen_stateful_random_ops = _tf_internal.random_op_module(
    "gen_stateful_random_ops")
gen_stateless_random_ops = _tf_internal.random_op_module(
    "gen_stateless_random_ops")
gen_stateless_random_ops_v2 = _tf_internal.random_op_module(
    "gen_stateless_random_ops_v2")

NORMAL, UNIFORM = 0.0, 0.5

# (module, wrapper) -> (op type, constant drawn instead).
_NEUTRAL = {
    (gen_random_ops, "random_standard_normal"): ("RandomStandardNormal",
                                                 NORMAL),
    (gen_random_ops, "truncated_normal"): ("TruncatedNormal", NORMAL),
    (gen_random_ops, "random_uniform"): ("RandomUniform", UNIFORM),
    (gen_stateless_random_ops, "stateless_random_normal"): (
        "StatelessRandomNormal", NORMAL),
    (gen_stateless_random_ops, "stateless_truncated_normal"): (
        "StatelessTruncatedNormal", NORMAL),
    (gen_stateless_random_ops, "stateless_random_uniform"): (
        "StatelessRandomUniform", UNIFORM),
    (gen_stateless_random_ops_v2, "stateless_random_normal_v2"): (
        "StatelessRandomNormalV2", NORMAL),
    (gen_stateless_random_ops_v2, "stateless_truncated_normal_v2"): (
        "StatelessTruncatedNormalV2", NORMAL),
    (gen_stateless_random_ops_v2, "stateless_random_uniform_v2"): (
        "StatelessRandomUniformV2", UNIFORM),
    (gen_stateful_random_ops, "stateful_standard_normal"): (
        "StatefulStandardNormal", NORMAL),
    (gen_stateful_random_ops, "stateful_standard_normal_v2"): (
        "StatefulStandardNormalV2", NORMAL),
    (gen_stateful_random_ops, "stateful_truncated_normal"): (
        "StatefulTruncatedNormal", NORMAL),
    (gen_stateful_random_ops, "stateful_uniform"): ("StatefulUniform",
                                                    UNIFORM),
}

# Every op type that draws random numbers (looked for in the traced graph).
RANDOM_OP_TYPES = frozenset(
    [op for op, _ in _NEUTRAL.values()] + [
        "RandomUniformInt", "ParameterizedTruncatedNormal", "RandomShuffle",
        "Multinomial", "RandomGamma", "RandomPoisson", "RandomPoissonV2",
        "StatelessRandomUniformInt", "StatelessRandomUniformFullInt",
        "StatelessMultinomial", "StatelessRandomBinomial",
        "StatelessRandomGammaV2", "StatelessRandomGammaV3",
        "StatelessRandomPoisson", "StatelessParameterizedTruncatedNormal",
        "StatelessRandomUniformIntV2", "StatelessRandomUniformFullIntV2",
        "StatelessShuffle", "RandomIndexShuffle", "StatefulUniformInt",
        "StatefulUniformFullInt", "StatefulRandomBinomial",
        "NonDeterministicInts", "RandomCrop", "SampleDistortedBoundingBox",
        "SampleDistortedBoundingBoxV2", "StatelessSampleDistortedBoundingBox"])

_REPLICA_SCOPE = re.compile(r"^(replica_\d+/)+")
# Frames in these folders are libraries, not the step being checked.
_LIBRARY_DIRS = tuple(
    os.path.join(os.path.realpath(p), "")
    for p in {sysconfig.get_path(k) for k in ("stdlib", "purelib", "platlib")})


def _caller():
  """'file.py:line in function' of the innermost frame outside libraries."""
  for frame in reversed(traceback.extract_stack()[:-2]):
    path = os.path.realpath(frame.filename)
    if path.startswith(_LIBRARY_DIRS) or path == os.path.realpath(__file__):
      continue
    if os.path.basename(path).startswith("__autograph_generated"):
      # AutoGraph's converted copy: its file and line mean nothing.
      return frame.name.removeprefix("tf__")
    return f"{os.path.basename(path)}:{frame.lineno} in {frame.name}"
  return "?"


class Draws:
  """What the traced steps drew: replaced ops, and random ops left in."""

  def __init__(self):
    self._lock = threading.Lock()
    self._replaced, self._left = {}, {}

  def _add(self, table, op_type, where):
    with self._lock:
      table.setdefault(op_type, set()).add(where)

  def replaced(self, op_type, scope):
    self._add(self._replaced, op_type,
              f"{_caller()} (scope {_scope(scope)})")

  def scan(self, graph):
    """Notes the random ops in `graph` and the functions it calls."""
    graph_def = graph.as_graph_def()
    nodes = list(graph_def.node)
    for function in graph_def.library.function:
      nodes.extend(function.node_def)
    for node in nodes:
      if node.op in RANDOM_OP_TYPES:
        self._add(self._left, node.op,
                  f"node {_scope(node.name)}")

  @property
  def replaced_ops(self):
    return _describe(self._replaced)

  @property
  def left_ops(self):
    return _describe(self._left)


def _scope(name):
  # One entry per place in the step: replica k's copy is the same place.
  return _REPLICA_SCOPE.sub("", name) or "(top level)"


def _describe(table):
  """'RandomStandardNormal at noisy/random_normal, ...' (sorted)."""
  return [f"{op} at {', '.join(sorted(places))}"
          for op, places in sorted(table.items())]


def _neutral(original, op_type, value, draws):
  signature = inspect.signature(original)

  def draw(*args, **kwargs):
    if tf.executing_eagerly():
      return original(*args, **kwargs)
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    dtype = tf.as_dtype(bound.arguments["dtype"])
    if not dtype.is_floating:
      return original(*args, **kwargs)
    draws.replaced(op_type, tf.compat.v1.get_default_graph().get_name_scope())
    shape = tf.cast(bound.arguments["shape"], tf.int64)
    return tf.fill(shape, tf.constant(value, dtype),
                   name=bound.arguments.get("name") or op_type)
  return draw


@contextlib.contextmanager
def neutralised():
  """Within: random ops traced draw their mean; yields the `Draws`.

  Replaces module attributes of TensorFlow for the whole process while
  inside: use it around the check's own tracing only.
  """
  draws = Draws()
  saved = []
  try:
    for (module, name), (op_type, value) in _NEUTRAL.items():
      original = getattr(module, name)
      saved.append((module, name, original))
      setattr(module, name, _neutral(original, op_type, value, draws))
    yield draws
  finally:
    for module, name, original in saved:
      setattr(module, name, original)
