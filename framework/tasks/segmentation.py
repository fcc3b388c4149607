"""Confusion-matrix metrics, summed over replicas like every eval total.

A confusion matrix is a sum of counts, so each replica counts its part of a
batch and the trainer's SUM-reduction gives the global matrix; accuracy,
per-class IoU and mean IoU are then read off the global matrix (averaging
per-replica IoUs would be wrong: IoU is a ratio).
"""

import numpy as np
import tensorflow as tf
import types
from framework.core.controller import Controller
from framework.core.trainer import Trainer
from framework.data.inputs import to_float
from framework.data.text import is_text


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
    self.last_confusion = None

  def eval_sums(self, labels, logits, mask=None):
    sums = super().eval_sums(labels, logits, mask=mask)
    # The logits' static last axis: a subclassed model has no output_shape.
    sums["confusion"] = confusion_matrix(labels, logits,
                                         int(logits.shape[-1]), mask)
    return sums

  def eval_results(self, totals):
    totals = dict(totals)
    self.last_confusion = np.asarray(totals.pop("confusion"))
    return super().eval_results(totals)


# Mask colours by class (RGB); classes past the end reuse them cyclically.
PALETTE = np.array([[40, 40, 40], [230, 25, 75], [60, 180, 75],
                    [0, 130, 200], [255, 225, 25], [145, 30, 180],
                    [70, 240, 240], [240, 50, 230]], np.uint8)
TRIPLETS_TAG = "image_true_predicted"


def is_segmentation(dataset):
  """Whether `dataset` has one label per pixel (masks) rather than per image
  (token sequences have one per token: not segmentation)."""
  if is_text(dataset):
    return False
  shape = getattr(dataset, "label_shape", None)
  if shape is None:  # A user's dataset object with arrays only.
    return np.ndim(dataset.train_y) > 1
  return len(shape) > 0


def colorize(masks):
  """Class masks [..., H, W] to RGB uint8 images [..., H, W, 3]."""
  return PALETTE[np.asarray(masks) % len(PALETTE)]


def triplets(model, images, masks):
  """uint8 [k, H, 3W, 3]: each image beside its true and predicted mask."""
  logits = model(to_float(tf.constant(images)), training=False)
  predicted = np.argmax(np.asarray(logits), axis=-1)
  images = np.asarray(images, np.uint8)
  if images.shape[-1] == 1:
    images = np.repeat(images, 3, axis=-1)
  return np.concatenate([images, colorize(masks), colorize(predicted)],
                        axis=2)


class SegmentationTrainer(ConfusionTrainer):
  """Reports loss, pixel accuracy, mean IoU and per-class IoU on evaluation.

  Its accuracy is `pixel_accuracy` (`metric_aliases`: what
  `stop_at_accuracy`, `stop_when=eval/accuracy...` and the run's record
  read).
  """

  metric_aliases = types.MappingProxyType({"accuracy": "pixel_accuracy"})

  def eval_results(self, totals):
    results = super().eval_results(totals)
    iou, mean_iou = iou_metrics(self.last_confusion)
    results["pixel_accuracy"] = results.pop("accuracy")
    results["mean_iou"] = mean_iou
    for index, value in enumerate(iou):
      results[f"iou/class_{index}"] = float(value)
    return results


class MaskSummaries:
  """An eval action: writes (image, true mask, predicted mask) triplets of
  `samples` under `eval/image_true_predicted` after each evaluation."""

  def __init__(self, controller, samples):
    self.controller = controller
    self.samples = samples

  def __call__(self, step, results):
    images, masks = self.samples
    self.controller.writer("eval").images(
        step, TRIPLETS_TAG, triplets(self.controller.trainer.model, images,
                                     masks), max_outputs=len(images))


class SegmentationController(Controller):
  """A Controller that also writes mask triplets with each evaluation (the
  `MaskSummaries` eval action).

  Args:
    samples: (images uint8 [k, H, W, C], masks [k, H, W]) shown in
      TensorBoard under `eval/image_true_predicted`.
    Everything else as `Controller`.
  """

  def __init__(self, *args, samples=None, **kwargs):
    super().__init__(*args, **kwargs)
    self.samples = samples
    if samples is not None:
      self.eval_actions.insert(0, MaskSummaries(self, samples))
