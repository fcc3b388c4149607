"""distloop's file format: sharded TFRecords of `tf.train.Example` + a sidecar.

A split (`train`, `test`) of a dataset directory is

    <split>-00000-of-00008.tfrecord ... <split>-00007-of-00008.tfrecord
    <split>.json   {"format": "distloop.tfrecord/1", "shards": [names],
                    "examples_per_shard": [ints], "num_examples": int,
                    "image_shape": [H, W, C], "label_shape": [] or [H, W],
                    "class_names": [...]}

Each record is a `tf.train.Example` with `image` (PNG bytes, uint8),
`label` (int64; classification), `mask` (PNG bytes of a uint8 [H, W, 1]
class mask; segmentation, instead of `label`) and `index` (int64: the
example's position in its source split, which seeds its augmentation exactly
as `framework.data.inputs` does for in-memory arrays). The sidecar lets a reader
plan epochs and resume positions without opening a shard.
"""

import io
import json
import os

import numpy as np

from framework.errors import DataError, check_positive

FORMAT = "distloop.tfrecord/1"
SPLITS = ("train", "test")


def shard_name(split, shard, num_shards):
  return f"{split}-{shard:05d}-of-{num_shards:05d}.tfrecord"


def encode_png(array):
  """uint8 [H, W] or [H, W, C] (C in 1, 3, 4) to PNG bytes (lossless)."""
  from PIL import Image  # pylint: disable=g-import-not-at-top
  array = np.asarray(array)
  if array.dtype != np.uint8:
    raise DataError(f"images must be uint8 to be stored as PNG (got "
                    f"{array.dtype})")
  if array.ndim == 3 and array.shape[-1] == 1:
    array = array[..., 0]
  buffer = io.BytesIO()
  Image.fromarray(array).save(buffer, format="PNG", compress_level=1)
  return buffer.getvalue()


def _bytes(value):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  return tf.train.Feature(bytes_list=tf.train.BytesList(value=[value]))


def _int64(value):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  return tf.train.Feature(int64_list=tf.train.Int64List(value=[int(value)]))


def encode_example(index, image, label):
  """One serialized `tf.train.Example`; an array `label` is a mask."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  feature = {"image": _bytes(encode_png(image)), "index": _int64(index)}
  label = np.asarray(label)
  if label.ndim:
    if label.min() < 0 or label.max() > 255:
      raise DataError(f"mask values must be classes in 0..255 (got "
                      f"{label.min()}..{label.max()})")
    feature["mask"] = _bytes(encode_png(label.astype(np.uint8)))
  else:
    feature["label"] = _int64(label)
  return tf.train.Example(features=tf.train.Features(
      feature=feature)).SerializeToString()


def write_split(output_dir, split, get_example, num_examples, *, num_shards,
                class_names, name="tfrecord", shuffle_seed=0, progress=None):
  """Writes `num_examples` examples as `num_shards` shards + `<split>.json`.

  Args:
    get_example: `i -> (image uint8 [H, W, C], label int or mask [H, W])` for
      i in [0, num_examples): random access, so that the examples can be
      dealt to the shards in a shuffled order (each shard a random sample:
      classes sorted in the source do not end up in a few shards) without
      holding the split in memory.
    name: the dataset's name (recorded, shown in logs).
    shuffle_seed: the order of the examples across shards (None: in order).
    progress: optional `fn(done, total)` called after each example.

  Returns:
    The sidecar dict.
  """
  check_positive("num_shards", num_shards)
  check_positive("num_examples", num_examples)
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  num_shards = min(num_shards, num_examples)
  order = np.arange(num_examples)
  if shuffle_seed is not None:
    order = np.random.default_rng(shuffle_seed).permutation(num_examples)
  os.makedirs(output_dir, exist_ok=True)
  names, counts = [], []
  image_shape = label_shape = None
  done = 0
  for shard, indices in enumerate(np.array_split(order, num_shards)):
    shard_file = shard_name(split, shard, num_shards)
    with tf.io.TFRecordWriter(os.path.join(output_dir, shard_file)) as writer:
      for i in indices:
        image, label = get_example(int(i))
        image = np.asarray(image)
        if image.ndim == 2:
          image = image[..., None]
        shapes = (tuple(image.shape), tuple(np.shape(label)))
        if image_shape is None:
          image_shape, label_shape = shapes
        elif shapes != (image_shape, label_shape):
          raise DataError(
              f"{split} example {int(i)} has image shape {shapes[0]} and "
              f"label shape {shapes[1]}; earlier examples have "
              f"{image_shape} and {label_shape} (resize with --image_size)")
        writer.write(encode_example(int(i), image, label))
        done += 1
        if progress is not None:
          progress(done, num_examples)
    names.append(shard_file)
    counts.append(len(indices))
  sidecar = {"format": FORMAT, "name": name, "split": split, "shards": names,
             "examples_per_shard": counts, "num_examples": int(sum(counts)),
             "image_shape": list(image_shape),
             "label_shape": list(label_shape),
             "class_names": list(class_names)}
  with open(os.path.join(output_dir, f"{split}.json"), "w") as f:
    json.dump(sidecar, f, indent=1)
  return sidecar


def read_sidecar(data_dir, split):
  """The sidecar of `split` in `data_dir`, checked (DataError if not valid)."""
  path = os.path.join(data_dir, f"{split}.json")
  try:
    with open(path) as f:
      sidecar = json.load(f)
  except OSError:
    raise DataError(f"data_dir={data_dir!r} is not a distloop TFRecord "
                    f"directory: {path} is missing (write one with "
                    "scripts/make_tfrecords.py)") from None
  except ValueError as e:
    raise DataError(f"{path} is not valid JSON: {e}") from None
  keys = ("shards", "examples_per_shard", "num_examples", "image_shape",
          "label_shape", "class_names")
  missing = [k for k in keys if k not in sidecar]
  if sidecar.get("format") != FORMAT or missing:
    raise DataError(f"{path} is not a {FORMAT} sidecar (format="
                    f"{sidecar.get('format')!r}, missing: {missing})")
  if (len(sidecar["shards"]) != len(sidecar["examples_per_shard"]) or
      sum(sidecar["examples_per_shard"]) != sidecar["num_examples"]):
    raise DataError(f"{path}: shards, examples_per_shard and num_examples "
                    "disagree")
  absent = [s for s in sidecar["shards"]
            if not os.path.isfile(os.path.join(data_dir, s))]
  if absent:
    raise DataError(f"{path} names shards that are missing: "
                    f"{', '.join(absent[:3])}")
  return sidecar


def parse_fn(image_shape, label_shape):
  """`serialized -> (index int64, image uint8 [H, W, C], label int32)`."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  per_pixel = bool(label_shape)
  features = {"image": tf.io.FixedLenFeature([], tf.string),
              "index": tf.io.FixedLenFeature([], tf.int64)}
  if per_pixel:
    features["mask"] = tf.io.FixedLenFeature([], tf.string)
  else:
    features["label"] = tf.io.FixedLenFeature([], tf.int64)

  def parse(serialized):
    example = tf.io.parse_single_example(serialized, features)
    image = tf.io.decode_png(example["image"], channels=image_shape[-1])
    image = tf.ensure_shape(image, image_shape)
    if per_pixel:
      label = tf.io.decode_png(example["mask"], channels=1)[..., 0]
      label = tf.ensure_shape(tf.cast(label, tf.int32), label_shape)
    else:
      label = tf.cast(example["label"], tf.int32)
    return example["index"], image, label

  return parse


def read_split_arrays(data_dir, split):
  """(index, images, labels) of a whole split as numpy, in index order (for
  tests and small tools; training streams with `framework.data.file_input`)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  sidecar = read_sidecar(data_dir, split)
  files = [os.path.join(data_dir, s) for s in sidecar["shards"]]
  parse = parse_fn(sidecar["image_shape"], sidecar["label_shape"])
  rows = [parse(r) for r in tf.data.TFRecordDataset(files)]
  index = np.array([int(r[0]) for r in rows])
  order = np.argsort(index)
  images = np.stack([r[1].numpy() for r in rows])[order]
  labels = np.stack([r[2].numpy() for r in rows])[order]
  return index[order], images, labels
