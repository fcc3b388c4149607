"""Device streams: each stage device runs its ops one at a time, in order.

A GPU runs a stage's kernels on one stream, one after another. Logical CPU
devices have no streams: TensorFlow's executor runs any ready op on any
inter-op thread, so one stage may run two ops at once (a layer's input and
weight gradients) and hold both cores while the other stage's ready op
waits. The pipeline then has a bubble of its own making, on top of GPipe's.

`DeviceStreams` restores stream semantics inside a `tf.function`: every op
created inside `streams.on(key)` gets a control input from the op created
before it on the same key, so the ops of one key form a single chain in
program order. Program (creation) order is a topological order of the
whole graph, so chains drawn along it never make a cycle; the ops of
different keys stay free to overlap, as two streams do. Within a block,
`first` can move the ops some outputs need ahead of the rest (any order of
a block's ops that keeps its data dependencies, and comes after every
earlier block, is still acyclic: see `_urgent_first`).

The cost: a control input on the first op of a fusable pattern can stop
Grappler from fusing it (say MatMul + BiasAdd), so results may differ from
the unchained model in the last bits (1e-7), and kernels can be a little
slower. Off by default; `PipelineTrainer(serial_stages=True)` turns it on.
"""

import contextlib

import tensorflow as tf

from framework import _tf_internal


class _Block:
  """The ops of one `DeviceStreams.on` block; `first` marks urgent outputs."""

  def __init__(self):
    self.urgent = []

  def first(self, *tensors):
    """Runs the ops these tensors need before the block's other ops."""
    self.urgent.extend(t for t in tf.nest.flatten(tensors) if t is not None)


def _urgent_first(ops, urgent):
  """`ops` (in creation order) with the ancestors of `urgent` moved first.

  Still a topological order: the ancestors of a set are closed under
  taking inputs, and each part keeps creation order.
  """
  block = set(ops)
  needed, todo = set(), [t.op for t in urgent if t.op in block]
  while todo:
    op = todo.pop()
    if op in needed:
      continue
    needed.add(op)
    todo.extend(i.op for i in op.inputs if i.op in block)
    todo.extend(c for c in op.control_inputs if c in block)
  return ([op for op in ops if op in needed] +
          [op for op in ops if op not in needed])


class DeviceStreams:
  """Chains the ops created under each key into one sequence."""

  def __init__(self, enabled=True):
    self.enabled = bool(enabled)
    self._last = {}

  @contextlib.contextmanager
  def on(self, key):
    """Ops created in this block run after every earlier op of `key`.

    Yields a block whose `first(tensors)` puts the ops those tensors need
    ahead of the block's other ops: a stage sends its input gradient to the
    stage before it as soon as it is computed, and computes its weight
    gradients after (the B-before-W order of zero-bubble pipelines), so
    the stage before it waits for less. Without `first`, creation order.

    `key` None (e.g. a stage spread over several devices) chains nothing.
    """
    graph = tf.compat.v1.get_default_graph()
    block = _Block()
    if not (self.enabled and key is not None and graph.building_function):
      yield block
      return
    start = len(graph.get_operations())
    yield block
    ops = graph.get_operations()[start:]
    if block.urgent:
      ops = _urgent_first(ops, block.urgent)
    last = self._last.get((graph, key))
    for op in ops:
      if last is not None:
        # No public API adds a control input to an op that already exists
        # (the gradient ops are made inside tape.gradient).
        _tf_internal.add_control_input(op, last)
      last = op
    self._last[(graph, key)] = last
