"""TensorBoard writers: only the chief writes; values arrive already reduced."""

import os

import tensorflow as tf


class SummaryWriter:
  """Scalars and text under `model_dir/<name>` (a no-op on non-chief tasks)."""

  def __init__(self, model_dir, name, *, enabled=True):
    self.logdir = os.path.join(model_dir, name)
    self._writer = (tf.summary.create_file_writer(self.logdir) if enabled
                    else tf.summary.create_noop_writer())

  def scalars(self, step, values):
    with self._writer.as_default(step=step):
      for tag, value in values.items():
        tf.summary.scalar(tag, value)
    self._writer.flush()

  def text(self, step, tag, markdown):
    with self._writer.as_default(step=step):
      tf.summary.text(tag, markdown)
    self._writer.flush()

  def images(self, step, tag, images, max_outputs=3):
    with self._writer.as_default(step=step):
      tf.summary.image(tag, images, max_outputs=max_outputs)
    self._writer.flush()

  def close(self):
    self._writer.close()


def markdown_table(values):
  """A two-column markdown table of `values` (e.g. the run's flags)."""
  rows = [f"| {k} | {v} |" for k, v in sorted(values.items())]
  return "\n".join(["| name | value |", "|---|---|"] + rows)
