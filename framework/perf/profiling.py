"""TensorFlow's profiler around chosen steps, and where the time went.

    profiler = StepProfiler((first, last), logdir)   # e.g. (10, 14)
    profiler.maybe_start(step)        # before the loop that runs step+1
    profiler.maybe_stop(step)         # after it; returns an OpTable

The trace lands in `logdir/plugins/profile/<run>/*.xplane.pb`, which
TensorBoard's Profile tab shows (`pip install tensorboard-plugin-profile`).
`op_table` reads the same file without TensorBoard: time per TF op type,
so a run's log and its text summary say where the time went.
"""

import dataclasses
import glob
import os
import shutil
import tempfile

from absl import logging
import tensorflow as tf

from framework.errors import ConfigError

# Ops whose events wrap other ops' events: counting them would count twice.
_CONTAINER_OPS = frozenset({"While", "StatelessWhile", "If", "StatelessIf",
                            "PartitionedCall", "StatefulPartitionedCall",
                            "__inference", "Case"})


def check_profile_steps(profile_steps):
  """Validates `(first, last)` global steps (1-based, inclusive) or ()."""
  steps = tuple(profile_steps or ())
  if not steps:
    return ()
  if (len(steps) != 2 or not all(isinstance(s, int) and not isinstance(
      s, bool) for s in steps) or not 1 <= steps[0] <= steps[1]):
    raise ConfigError(
        f"profile_steps={profile_steps!r} must be two integers first,last "
        "with 1 <= first <= last (global steps, inclusive), or empty")
  return steps


@dataclasses.dataclass(frozen=True)
class OpTable:
  """Time per TF op type in one profiled window.

  Attributes:
    rows: (op type, milliseconds, count), most time first.
    wall_ms: the window's wall time (op times overlap when ops run in
      parallel, so their sum can exceed it).
    trace_path: the `.xplane.pb` file read.
    names: (op name without its type, milliseconds) of every op, for
      `share`.
  """
  rows: tuple
  wall_ms: float
  trace_path: str
  names: tuple = ()

  def share(self, predicate):
    """The fraction of all op time spent in ops whose name (scopes
    included, e.g. `gradient_tape/cifar_cnn_1/conv2d/Conv2DBackpropInput`)
    satisfies `predicate`."""
    total = sum(ms for _, ms in self.names)
    return sum(ms for name, ms in self.names if predicate(name)) / (
        total or 1.0)

  @property
  def total_ms(self):
    return sum(ms for _, ms, _ in self.rows)

  def as_dict(self, top=None):
    """JSON-ready: wall and op time, and the `top` rows (all by default)."""
    return {"wall_ms": self.wall_ms, "total_ms": self.total_ms,
            "rows": [list(row) for row in self.rows[:top]]}

  def markdown(self, top=15):
    """The `top` op types as a markdown table (share of all op time)."""
    total = self.total_ms or 1.0
    lines = [f"wall {self.wall_ms:.1f} ms, op time {self.total_ms:.1f} ms "
             f"(parallel ops overlap)", "",
             "| op type | ms | share | count |", "|---|---|---|---|"]
    for name, ms, count in self.rows[:top]:
      lines.append(f"| {name} | {ms:.1f} | {ms / total:.1%} | {count} |")
    return "\n".join(lines)


def load_xspace(trace_path):
  """The `XSpace` protocol buffer of a `*.xplane.pb` profiler trace."""
  try:
    from tensorflow.tsl.profiler.protobuf import xplane_pb2  # pylint: disable=g-import-not-at-top
  except ImportError:
    from tsl.profiler.protobuf import xplane_pb2  # pylint: disable=g-import-not-at-top
  space = xplane_pb2.XSpace()
  with open(trace_path, "rb") as f:
    space.ParseFromString(f.read())
  return space


def latest_trace(logdir):
  """The newest `*.xplane.pb` under `logdir/plugins/profile`, or None."""
  paths = glob.glob(os.path.join(logdir, "plugins", "profile", "*",
                                 "*.xplane.pb"))
  return max(paths, key=os.path.getmtime) if paths else None


def op_table(trace_path):
  """Reads a profiler trace: time per op type on TF's executor threads.

  Long windows (seconds, thousands of ops) can lose some short op events in
  the profiler itself; keep windows to a few steps when counts matter.
  """
  space = load_xspace(trace_path)
  totals, counts, by_name = {}, {}, {}
  first, last = None, None
  for plane in space.planes:
    if not plane.name.startswith("/host:CPU"):
      continue
    for line in plane.lines:
      # Ops run on the executor's inter-op threads ("tf_Compute"); the
      # intra-op threads only help the op that owns them.
      if not line.name.startswith("tf_Compute"):
        continue
      base = line.timestamp_ns * 1000
      for event in line.events:
        meta = plane.event_metadata[event.metadata_id]
        # Op events are "scope/name:OpType"; executor bookkeeping has "::".
        if ":" not in meta.name or "::" in meta.name:
          continue
        op_type = meta.display_name or meta.name.rsplit(":", 1)[-1]
        if op_type in _CONTAINER_OPS:
          continue
        ms = event.duration_ps / 1e9
        totals[op_type] = totals.get(op_type, 0.0) + ms
        counts[op_type] = counts.get(op_type, 0) + 1
        name = meta.name.rsplit(":", 1)[0]
        by_name[name] = by_name.get(name, 0.0) + ms
        start = base + event.offset_ps
        first = start if first is None else min(first, start)
        end = start + event.duration_ps
        last = end if last is None else max(last, end)
  rows = tuple(sorted(((k, totals[k], counts[k]) for k in totals),
                      key=lambda row: -row[1]))
  wall = (last - first) / 1e9 if rows else 0.0
  return OpTable(rows=rows, wall_ms=wall, trace_path=trace_path,
                 names=tuple(sorted(by_name.items())))


def profile_op_table(fn):
  """Runs `fn()` under the profiler (in a temporary directory); its OpTable."""
  logdir = tempfile.mkdtemp(prefix="distloop_profile_")
  try:
    tf.profiler.experimental.start(logdir)
    try:
      fn()
    finally:
      tf.profiler.experimental.stop()
    return op_table(latest_trace(logdir))
  finally:
    shutil.rmtree(logdir, ignore_errors=True)


class StepProfiler:
  """Traces global steps `first..last` of a run into `logdir`.

  Args:
    profile_steps: `(first, last)`, 1-based and inclusive, or () for none.
    logdir: where the trace goes (a TensorBoard run directory).
  """

  def __init__(self, profile_steps, logdir):
    self.profile_steps = check_profile_steps(profile_steps)
    self.logdir = logdir
    self.active = False

  def boundaries(self):
    """Steps at which a loop must end so that the window is exact."""
    if not self.profile_steps:
      return ()
    first, last = self.profile_steps
    return (first - 1, last)

  def maybe_start(self, step):
    """Starts tracing if the next loop begins the window (at step+1)."""
    if self.profile_steps and step == self.profile_steps[0] - 1:
      tf.profiler.experimental.start(self.logdir)
      self.active = True

  def maybe_stop(self, step, *, force=False):
    """Stops at the window's end (or when `force`d, e.g. the run ended
    first); returns its OpTable, else None."""
    if not self.active or (step < self.profile_steps[1] and not force):
      return None
    tf.profiler.experimental.stop()
    self.active = False
    path = latest_trace(self.logdir)
    if path is None:
      logging.warning("profiler wrote no trace under %s", self.logdir)
      return None
    return op_table(path)
