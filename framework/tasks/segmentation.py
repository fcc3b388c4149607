"""Semantic segmentation: per-pixel metrics and image summaries.

Training needs nothing new: `Trainer.average` averages a per-pixel loss over
every pixel of the global batch (each example's pixel mean, summed over
replicas and divided by `global_batch_size`; images have the same size, so
this is the mean over all pixels). Evaluation sums a confusion matrix over
replicas and reads pixel accuracy and IoU off the global matrix; TensorBoard
gets image | true mask | predicted mask triplets.
"""

import types

import numpy as np
import tensorflow as tf

from framework.core.controller import Controller
from framework.data.inputs import to_float
from framework.data.text import is_text
from framework.tasks.metrics import ConfusionTrainer, iou_metrics

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
