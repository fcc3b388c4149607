"""TensorBoard writers: only the chief writes; values arrive already reduced.

Every scalar a `SummaryWriter` writes also goes to its metric sinks: any
object with `write(step, split, values)` (`MetricSink`), e.g. the
`metrics.jsonl` file every run writes (`framework.core.summaries`).
TensorBoard stays the default; a sink adds a copy of the same points.
"""

import contextlib
import json
import numbers
import os
import time
from typing import Mapping, Protocol, Sequence, runtime_checkable

from absl import logging
from tensorboard.plugins.hparams import api as hp
import numpy as np
import tensorflow as tf

from framework.core.checkpoints import run_files
from framework.distribute import strategies
from framework.errors import ModelDirError


@runtime_checkable
class MetricSink(Protocol):
  """Where a run's scalars go besides TensorBoard.

  `write` gets each summary point as TensorBoard gets it: the step, the
  split (the writer's folder under model_dir: `train`, `eval`, ...), and
  {name: float}; `time` is the wall time of the point. Optional: the
  Controller calls `restart(step)` once a relaunch restored `step` (the
  points past it will be written again: drop them).
  """

  def write(self, step: int, split: str, values: Mapping[str, float],
            time: float) -> None:  # pylint: disable=redefined-outer-name
    ...


class SummaryWriter:
  """Scalars and text under `model_dir/<name>` (a no-op on non-chief tasks).

  Args:
    model_dir, name: the folder `model_dir/<name>`.
    enabled: False on non-chief tasks: nothing is written anywhere.
    sinks: `MetricSink`s that get every scalar point as well (split
      `name`).
  """

  def __init__(self, model_dir, name, *, enabled=True,
               sinks: Sequence[MetricSink] = ()):
    self.logdir = os.path.join(model_dir, name)
    self.name = name
    self._writer = (tf.summary.create_file_writer(self.logdir) if enabled
                    else tf.summary.create_noop_writer())
    # The caller's list itself: a sink appended to it later gets points too.
    self.sinks = sinks if enabled else []

  def as_default(self, step=None):
    """A context with this writer as the default for `tf.summary` calls
    (e.g. those inside a train step), at `step` (an int or a variable)."""
    return self._writer.as_default(step=step)

  def scalars(self, step, values):
    with self._writer.as_default(step=step):
      for tag, value in values.items():
        tf.summary.scalar(tag, value)
    self._writer.flush()
    if self.sinks:
      now = time.time()
      points = {tag: float(value) for tag, value in values.items()}
      for sink in self.sinks:
        sink.write(int(step), self.name, points, now)

  def text(self, step, tag, markdown):
    with self._writer.as_default(step=step):
      tf.summary.text(tag, markdown)
    self._writer.flush()

  def hparams(self, values, start_time_secs=None):
    """Marks this directory as one session of TensorBoard's HParams
    dashboard, with `values` (e.g. the run's flags) as its hyperparameters.

    The dashboard's metrics are the last values of the scalars in this
    directory and below it (e.g. `eval/accuracy`: tag `accuracy` of the
    `eval` subdirectory), so a sweep's runs compare in one table. No
    experiment config is written: TensorBoard takes one arbitrary run's, so
    runs of a sweep would hide each other's hyperparameters; inferred, the
    columns are the union over all runs.
    """
    with self._writer.as_default(step=0):
      hp.hparams({k: hparam_value(v) for k, v in values.items()},
                 start_time_secs=start_time_secs)
    self._writer.flush()

  def images(self, step, tag, images, max_outputs=3):
    with self._writer.as_default(step=step):
      tf.summary.image(tag, images, max_outputs=max_outputs)
    self._writer.flush()

  def close(self):
    self._writer.close()


class Writers:
  """A run's `SummaryWriter`s by folder, each created on first use (so a run
  that fails while restoring leaves no new event files)."""

  def __init__(self, model_dir, *, enabled=True,
               sinks: Sequence[MetricSink] = ()):
    self.model_dir, self.enabled, self.sinks = model_dir, enabled, sinks
    self._writers = {}

  def restart(self, step):
    """Tells the sinks that a relaunch restored `step` (`MetricSink`)."""
    for sink in self.sinks:
      if hasattr(sink, "restart"):
        sink.restart(step)

  def __call__(self, name):
    if name not in self._writers:
      self._writers[name] = SummaryWriter(self.model_dir, name,
                                          enabled=self.enabled,
                                          sinks=self.sinks)
    return self._writers[name]


@contextlib.contextmanager
def default_step(step):
  """`step` as the default step of `tf.summary` calls inside the context
  (restored after it, so that a traced tensor never leaks out), and their
  tags as written: without the name scope of an enclosing in-graph loop
  (`while/`), which `tf.summary` would otherwise put in front."""
  previous = tf.summary.experimental.get_step()
  tf.summary.experimental.set_step(step)
  try:
    with tf.compat.v1.name_scope(None):
      yield
  finally:
    tf.summary.experimental.set_step(previous)


def record_every(every):
  """A `tf.summary.record_if` condition: record on the default summary
  steps that `every` divides (read in-graph; 0: never)."""

  def condition():
    if not every:
      return False
    step = tf.summary.experimental.get_step()
    return tf.equal(tf.math.floormod(tf.cast(step, tf.int64), every), 0)

  return condition


def markdown_table(values):
  """A two-column markdown table of `values` (e.g. the run's flags)."""
  rows = [f"| {k} | {v} |" for k, v in sorted(values.items())]
  return "\n".join(["| name | value |", "|---|---|"] + rows)


def hparam_value(value):
  """`value` as the HParams dashboard takes it: a bool, int, float or str
  (lists as their comma-separated flag syntax, None as "None")."""
  if isinstance(value, (bool, str)):
    return value
  if isinstance(value, numbers.Integral):
    return int(value)
  if isinstance(value, numbers.Real):
    return float(value)
  if isinstance(value, (list, tuple)):
    return ",".join(str(v) for v in value)
  return str(value)


# `metrics.jsonl`: every summary point of a run as one JSON line.
#
#     {"step": 100, "time": 1764750000.1, "split": "eval", "name": "accuracy",
#      "value": 0.8125}
#
# The chief's Controller writes it beside the event files (`model_dir/
# metrics.jsonl`), the same points TensorBoard shows (every scalar the
# Controller writes: `train/`, `eval/`, ...; scalars a custom step records
# with `tf.summary` inside its graph reach the event files only). Read it
# with `read_metrics` or any JSON-lines reader, e.g. pandas'
# `read_json(path, lines=True)`.
#
# Each line is appended with one `write` to a file opened for appending, so
# a killed run leaves whole lines (and at most one cut last line, which the
# next start drops). A relaunch resumes from its latest checkpoint and trains
# the steps after it again: on restart the file first loses every line past
# the restored step, so no step appears twice.
METRICS_FILE = "metrics.jsonl"


def _parse(line):
  """The point a line holds, or None for a cut or foreign line."""
  try:
    point = json.loads(line)
    int(point["step"]), str(point["split"]), str(point["name"])
    float(point["value"])
    return point
  except (ValueError, TypeError, KeyError):
    return None


def read_metrics(path):
  """The points of a metrics file, in order (lines that do not parse, e.g.
  the cut last line of a killed run, are left out)."""
  if not tf.io.gfile.exists(path):
    return []
  with tf.io.gfile.GFile(path) as f:
    return [p for p in map(_parse, f.read().splitlines()) if p is not None]


class JsonlSink:
  """A `framework.core.summaries.MetricSink` appending to a JSON-lines file.

  Args:
    path: the file (created on the first point; its folder must exist).
  """

  def __init__(self, path: str):
    self.path = path

  def write(self, step: int, split: str, values: Mapping[str, float],
            time: float) -> None:  # pylint: disable=redefined-outer-name
    text = "".join(
        json.dumps({"step": int(step), "time": round(float(time), 3),
                    "split": split, "name": name, "value": float(value)})
        + "\n" for name, value in values.items())
    if "://" in self.path:  # no O_APPEND on remote file systems
      with tf.io.gfile.GFile(self.path, "a") as f:
        f.write(text)
      return
    # One write() of a file opened with O_APPEND: a concurrent reader or a
    # kill sees whole lines (the points of one call together).
    fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
      os.write(fd, text.encode())
    finally:
      os.close(fd)

  def restart(self, step: int) -> None:
    """Drops the lines past `step` (and a cut last line): the relaunch that
    restored `step` writes those steps again."""
    if not tf.io.gfile.exists(self.path):
      return
    try:
      with tf.io.gfile.GFile(self.path) as f:
        lines = f.read().splitlines()
    except tf.errors.OpError as e:  # a directory in its place
      raise ModelDirError(f"cannot read {self.path} "
                          f"({str(e).splitlines()[0]}); move it away") from None
    keep = [line for line in lines
            if (point := _parse(line)) is not None and point["step"] <= step]
    if len(keep) == len(lines):
      return
    logging.info("%s: dropping %d points past the restored step %d (they "
                 "are trained again)", self.path, len(lines) - len(keep),
                 step)
    run_files.write_text(self.path, "".join(line + "\n" for line in keep))


# Each worker's step time, split into its own compute (input, forward,
# backward, the update, the loop's Python) and its wait in the gradient
# all-reduce (for the slowest task, and the transfer). The trainer sums
# the all-reduce's seconds in-graph (`collective_wait_seconds`); a loop's
# wall time less that is the compute. At summary and log steps every
# worker all-gathers its two numbers; the chief writes them to `train/`
# as `step_time/<task>_<index>/compute` and `.../wait` (seconds per step;
# metrics.jsonl too) and, at log steps, logs one line naming the workers
# whose compute exceeds the other workers' median `straggler_factor`
# times.
_ROLES = ("chief", "worker")


class WorkerStepTimes:
  """Gathers each worker's compute and wait per step; names stragglers.

  Every worker calls `record` at the same loops (it is a collective).

  Args:
    strategy: a MultiWorkerMirroredStrategy over a cluster.
    wait_seconds: `() -> float`: this task's seconds in the all-reduce so
      far.
    writer: the run's `Writers` (the chief's writes).
    straggler_factor: a worker whose compute per step exceeds the other
      workers' median this many times is named (> 1).
  """

  def __init__(self, strategy, wait_seconds, writer, straggler_factor):
    self.strategy = strategy
    self.wait_seconds = wait_seconds
    self.writer = writer
    self.factor = straggler_factor
    role, index = strategies.task_info(strategy)
    self._me = tf.constant(
        [[_ROLES.index(role) if role in _ROLES else -1, index]], tf.float64)
    self._last_wait = wait_seconds()
    self._gather = tf.function(self._gather_fn)

  def _gather_fn(self, row):
    def replica_fn(row):
      # Each replica's row at its place, summed: every row everywhere.
      context = tf.distribute.get_replica_context()
      table = tf.scatter_nd([[context.replica_id_in_sync_group]], row,
                            [context.num_replicas_in_sync, 4])
      return context.all_reduce(tf.distribute.ReduceOp.SUM, table)
    return self.strategy.experimental_local_results(
        self.strategy.run(replica_fn, args=(row,)))[0]

  def record(self, step, num_steps, elapsed, *, write=True, log=True):
    """Gathers the loop of `num_steps` steps that ended at `step` and took
    `elapsed` s here; the chief writes (`write`) and names stragglers
    (`log`). Returns {`role:index`: (compute, wait)} seconds per step."""
    total = self.wait_seconds()
    wait = max(total - self._last_wait, 0.0) / num_steps
    self._last_wait = total
    compute = max(elapsed / num_steps - wait, 0.0)
    row = tf.concat([self._me, [[compute, wait]]], axis=1)
    rows = self._gather(row).numpy()
    times = {}
    for role, index, c, w in rows:  # several local replicas: one row each
      times[f"{_ROLES[int(role)]}:{int(index)}"] = (float(c), float(w))
    if write:
      self.writer("train").scalars(step, {
          f"step_time/{name.replace(':', '_')}/{part}": value
          for name, pair in sorted(times.items())
          for part, value in zip(("compute", "wait"), pair)})
    if log and self.writer.enabled:
      self.name_stragglers(step, times)
    return times

  def name_stragglers(self, step, times):
    """Logs one line naming the workers whose compute per step exceeds
    the median of the other workers' `straggler_factor` times."""
    slow = []
    for name, (compute, _) in sorted(times.items()):
      others = float(np.median([c for n, (c, _) in times.items()
                                if n != name]))
      if compute > self.factor * others:
        slow.append(f"{name} {compute:.3f} s ({compute / max(others, 1e-9):.1f}x"
                    f" the others' median {others:.3f} s)")
    if slow:
      logging.warning(
          "straggler at step %d: %s, compute per step of %d workers "
          "(straggler_factor=%g); the others wait for it in every "
          "all-reduce", step, ", ".join(slow), len(times), self.factor)
