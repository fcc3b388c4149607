"""The one preprocessing contract between data and models.

    uint8 features (images) reach the model as float32 in [0, 1]
    (divided by 255); every other dtype (float features, int tokens)
    reaches it unchanged. Models never rescale their inputs.

The input pipeline applies it, so a model sees the same values in training,
in `evaluate.py`, in `predict.py` and in an exported SavedModel:

- the built-in datasets scale in their tf.data pipelines
  (`inputs.to_float`);
- a custom `train_input` / `eval_input` that gives a plain `tf.data.Dataset`
  is scaled by the Controller before it is distributed (`scale_batch`), so
  uint8 arrays of your own are treated exactly like CIFAR-10's;
- an already distributed dataset is yours: give it float32 in [0, 1]
  for images.

`model_info.json` records the contract (`CONTRACT`) so that a reader knows
which side scales.
"""

import tensorflow as tf
from framework.data.config import AUGMENTATIONS
from framework.data.inputs import MaskedBatch
from framework.errors import check_choice


# Recorded in model_info.json as "input_preprocessing".
CONTRACT = "uint8/255"


def scale_features(features):
  """uint8 -> float32 in [0, 1]; anything else as it is (nested too)."""

  def scale(value):
    if isinstance(value, tf.Tensor) and value.dtype == tf.uint8:
      return tf.cast(value, tf.float32) / 255.0
    return value

  return tf.nest.map_structure(scale, features)


def scale_batch(batch):
  """`scale_features` on a batch's features: the first element of a
  `(features, labels)` tuple (labels, e.g. uint8 masks, are left alone),
  inside a `MaskedBatch` too; a batch of features alone is scaled whole."""
  if isinstance(batch, MaskedBatch):
    return MaskedBatch(scale_batch(batch.batch), batch.mask)
  if isinstance(batch, tuple) and len(batch) >= 2:
    return (scale_features(batch[0]),) + tuple(batch[1:])
  return scale_features(batch)


def has_uint8_features(element_spec):
  """Whether `scale_batch` would scale anything in batches of this spec."""
  if isinstance(element_spec, MaskedBatch):
    element_spec = element_spec.batch
  if isinstance(element_spec, tuple) and len(element_spec) >= 2:
    element_spec = element_spec[0]
  return any(getattr(spec, "dtype", None) == tf.uint8
             for spec in tf.nest.flatten(element_spec))


def scaled_pixels(dataset, data=None):
  """(scaled, why): whether a model trained on `dataset` (or on `data`,
  the first `tf.data.Dataset` a custom `train_input` gives) gets uint8
  images divided by 255 (None: it cannot be told), and the reason, for a
  log line. A model that expects 0-255 pixels is handed its input times
  255 only then (`models.input_scale`)."""
  if data is not None:
    if not isinstance(data, tf.data.Dataset):
      return None, (
          "train_input gives a distributed dataset, passed to the model as "
          "it is: assumed it holds images in [0, 1] (the input contract); "
          "give a plain tf.data.Dataset to have its dtype decide")
    spec = data.element_spec
    if has_uint8_features(spec):
      return True, ("train_input gives uint8 images, which the input "
                    "pipeline divides by 255")
    if isinstance(spec, MaskedBatch):
      spec = spec.batch
    if isinstance(spec, tuple) and len(spec) >= 2:
      spec = spec[0]
    dtypes = sorted({getattr(s, "dtype", tf.float32).name
                     for s in tf.nest.flatten(spec)})
    return False, (f"train_input gives {'/'.join(dtypes)} features, which "
                   "reach the model as they are")
  name = getattr(dataset, "name", None)
  dtype = getattr(dataset, "feature_dtype", None)
  if dtype is None:
    return None, (
        f"dataset={name} does not say its features' dtype: assumed uint8 "
        "images, divided by 255 (give the dataset a feature_dtype "
        "attribute to have it decide)")
  if dtype == "uint8":
    return True, (f"dataset={name} has uint8 images, which the input "
                  "pipeline divides by 255")
  return False, (f"dataset={name} has {dtype} features, which reach the "
                 "model as they are")


def scale_dataset(dataset):
  """A plain `tf.data.Dataset` with the contract applied (unchanged if it
  has no uint8 features)."""
  if not has_uint8_features(dataset.element_spec):
    return dataset
  # tf.data passes a plain tuple's items as arguments (a namedtuple such
  # as MaskedBatch whole).
  if type(dataset.element_spec) is tuple:  # pylint: disable=unidiomatic-typecheck
    return dataset.map(lambda *batch: scale_batch(tuple(batch)))
  return dataset.map(scale_batch)


def _per_example_ints(seeds, count, maxval):
  """[B, count] ints in [0, maxval), a pure function of each example's seed."""
  return tf.map_fn(
      lambda seed: tf.random.stateless_uniform(
          [count], seed=seed, maxval=maxval, dtype=tf.int32),
      seeds, fn_output_signature=tf.int32)


def crop_flip(images, labels, seeds, padding=4):
  """Random `padding`-pixel translation (zero padding) and horizontal flip.

  The standard CIFAR augmentation: pad each side by `padding`, crop back to
  the original size at a random offset, and mirror half of the images.
  """
  height, width = images.shape[1], images.shape[2]
  draws = _per_example_ints(seeds, 3, 2 * padding + 1)
  top, left, flip = draws[:, 0], draws[:, 1], draws[:, 2] % 2
  padded = tf.pad(images, [[0, 0], [padding, padding], [padding, padding],
                           [0, 0]])
  # Gather the crop window's rows, then its columns (mirrored when flipped).
  rows = top[:, None] + tf.range(height)[None, :]
  cols = left[:, None] + tf.range(width)[None, :]
  cols = tf.where(flip[:, None] == 1, tf.reverse(cols, axis=[1]), cols)
  cropped = tf.gather(padded, rows, axis=1, batch_dims=1)
  cropped = tf.gather(cropped, cols, axis=2, batch_dims=1)
  return cropped, labels


def flip(images, labels, seeds):
  """Horizontal flip of (on average) half of the images.

  For short schedules, where a random crop's extra variety costs more
  epochs than it returns.
  """
  mirrored = _per_example_ints(seeds, 1, 2)[:, 0] == 1
  return tf.where(mirrored[:, None, None, None],
                  tf.reverse(images, axis=[2]), images), labels


def get_augmentation(name):
  """The augmentation function for `name` (None for `none`)."""
  check_choice("augment", name, AUGMENTATIONS)
  return {"none": None, "flip": flip, "crop_flip": crop_flip}[name]
