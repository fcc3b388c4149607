"""`metrics.jsonl`: every summary point of a run as one JSON line.

    {"step": 100, "time": 1764750000.1, "split": "eval", "name": "accuracy",
     "value": 0.8125}

The chief's Controller writes it beside the event files (`model_dir/
metrics.jsonl`), the same points TensorBoard shows (every scalar the
Controller writes: `train/`, `eval/`, ...; scalars a custom step records
with `tf.summary` inside its graph reach the event files only). Read it
with `read_metrics` or any JSON-lines reader, e.g. pandas'
`read_json(path, lines=True)`.

Each line is appended with one `write` to a file opened for appending, so
a killed run leaves whole lines (and at most one cut last line, which the
next start drops). A relaunch resumes from its latest checkpoint and trains
the steps after it again: on restart the file first loses every line past
the restored step, so no step appears twice.
"""

import json
import os
from typing import Mapping

from absl import logging
import tensorflow as tf

from framework.core import atomic

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
    with tf.io.gfile.GFile(self.path) as f:
      lines = f.read().splitlines()
    keep = [line for line in lines
            if (point := _parse(line)) is not None and point["step"] <= step]
    if len(keep) == len(lines):
      return
    logging.info("%s: dropping %d points past the restored step %d (they "
                 "are trained again)", self.path, len(lines) - len(keep),
                 step)
    atomic.write_text(self.path, "".join(line + "\n" for line in keep))
