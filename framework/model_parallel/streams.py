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
different keys stay free to overlap, as two streams do.

The cost: a control input on the first op of a fusable pattern can stop
Grappler from fusing it (say MatMul + BiasAdd), so results may differ from
the unchained model in the last bits (1e-7), and kernels can be a little
slower. Off by default; `PipelineTrainer(serial_stages=True)` turns it on.
"""

import contextlib

import tensorflow as tf


class DeviceStreams:
  """Chains the ops created under each key into one sequence."""

  def __init__(self, enabled=True):
    self.enabled = bool(enabled)
    self._last = {}

  @contextlib.contextmanager
  def on(self, key):
    """Ops created in this block run after every earlier op of `key`.

    `key` None (e.g. a stage spread over several devices) chains nothing.
    """
    graph = tf.compat.v1.get_default_graph()
    if not (self.enabled and key is not None and graph.building_function):
      yield
      return
    start = len(graph.get_operations())
    yield
    last = self._last.get((graph, key))
    for op in graph.get_operations()[start:]:
      if last is not None:
        # No public API adds a control input to an op that already exists
        # (the gradient ops are made inside tape.gradient).
        op._add_control_input(last)  # pylint: disable=protected-access
      last = op
    self._last[(graph, key)] = last
