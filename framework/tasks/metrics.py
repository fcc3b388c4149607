"""Confusion-matrix metrics, summed over replicas like every eval total.

A confusion matrix is a sum of counts, so each replica counts its part of a
batch and the trainer's SUM-reduction gives the global matrix; accuracy,
per-class IoU and mean IoU are then read off the global matrix (averaging
per-replica IoUs would be wrong: IoU is a ratio).
"""

import numpy as np
import tensorflow as tf

from framework.core.trainer import Trainer


def confusion_matrix(labels, logits, num_classes, mask=None):
  """Counts [num_classes, num_classes] (rows: true, columns: predicted).

  Works for any label shape (one per example, or one per pixel); `mask`
  [rows] weighs each example's labels (0.0: a padding row, not counted).
  """
  predicted = tf.argmax(logits, axis=-1, output_type=tf.int32)
  labels = tf.cast(labels, tf.int32)
  weights = None
  if mask is not None:
    mask = tf.cast(mask, tf.float32)
    # One weight per label: the example's, for each of its pixels.
    weights = tf.reshape(tf.broadcast_to(
        tf.reshape(mask, tf.concat([tf.shape(mask), tf.ones(
            [tf.rank(labels) - 1], tf.int32)], 0)), tf.shape(labels)), [-1])
  return tf.math.confusion_matrix(
      tf.reshape(labels, [-1]), tf.reshape(predicted, [-1]),
      num_classes=num_classes, weights=weights, dtype=tf.float32)


def iou_metrics(confusion):
  """(per-class IoU, mean IoU over classes that occur) from a global matrix."""
  confusion = np.asarray(confusion, np.float64)
  hits = np.diag(confusion)
  union = confusion.sum(0) + confusion.sum(1) - hits
  iou = np.divide(hits, union, out=np.zeros_like(hits), where=union > 0)
  return iou, float(iou[union > 0].mean()) if (union > 0).any() else 0.0


def format_confusion(confusion, class_names):
  """A text table: one row per true class, one column per predicted class."""
  confusion = np.asarray(confusion).astype(np.int64)
  cell = max(5, len(str(confusion.max())) + 1)
  label = max(len(n) for n in class_names) + 4
  header = " " * label + "".join(f"{i:>{cell}d}" for i in range(len(confusion)))
  rows = [f"{i:>2d} {name:<{label - 3}}" + "".join(f"{v:>{cell}d}" for v in row)
          for i, (name, row) in enumerate(zip(class_names, confusion))]
  return "\n".join(["rows: true class, columns: predicted class", header]
                   + rows)


class ConfusionTrainer(Trainer):
  """A Trainer whose evaluation also sums a confusion matrix over replicas.

  After `evaluate`, `last_confusion` holds the global matrix (numpy).
  """

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self.num_classes = int(self.model.output_shape[-1])
    self.last_confusion = None

  def eval_sums(self, labels, logits, mask=None):
    sums = super().eval_sums(labels, logits, mask=mask)
    sums["confusion"] = confusion_matrix(labels, logits, self.num_classes,
                                         mask)
    return sums

  def eval_results(self, totals):
    totals = dict(totals)
    self.last_confusion = np.asarray(totals.pop("confusion"))
    return super().eval_results(totals)
