"""distloop's file format: sharded TFRecords of `tf.train.Example` + a sidecar.

A split (`train`, `test`) of a dataset directory is

    <split>-00000-of-00008.tfrecord ... <split>-00007-of-00008.tfrecord
    <split>.json   {"format": "distloop.tfrecord/1", "shards": [names],
                    "examples_per_shard": [ints], "num_examples": int,
                    "image_shape": [H, W, C], "label_shape": [] or [H, W],
                    "class_names": [...], "bytes_per_shard": [ints],
                    "sha256_per_shard": [hex], "fingerprint_per_shard": [hex],
                    "generation": hex}

Each record is a `tf.train.Example` with `image` (PNG bytes, uint8),
`label` (int64; classification), `mask` (PNG bytes of a uint8 [H, W, 1]
class mask; segmentation, instead of `label`) and `index` (int64: the
example's position in its source split, which seeds its augmentation exactly
as `framework.data.inputs` does for in-memory arrays). The sidecar lets a reader
plan epochs and resume positions without opening a shard, and check what it
reads: shard sizes when the split is opened, record counts and fingerprints
as the shards stream (framework/data/integrity.py); `sha256_per_shard` is for
a full check (`make_tfrecords.py --verify`). `generation` is a digest of the
split's content: a re-converted split with other content has another one.
The fields are checked by framework/data/sidecar_schema.py. The converter
publishes splits through framework/data/tfrecord_set.py.
"""

import hashlib
import io
import json
import os

from absl import logging
import numpy as np

from framework.data import integrity, sidecar_schema, tfrecord_set
from framework.errors import DataError, check_positive

FORMAT = sidecar_schema.FORMAT
SPLITS = ("train", "test")
_WARNED_UNVERIFIED = set()


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
                class_names, name="tfrecord", shuffle_seed=0, progress=None,
                file_op=None):
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
    file_op: optional `fn(what)` called before each file operation (a test
      hook: make_tfrecords.py can stop itself there).

  Returns:
    The sidecar dict.
  """
  check_positive("num_shards", num_shards)
  check_positive("num_examples", num_examples)
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  file_op = file_op or (lambda what: None)
  num_shards = min(num_shards, num_examples)
  order = np.arange(num_examples)
  if shuffle_seed is not None:
    order = np.random.default_rng(shuffle_seed).permutation(num_examples)
  os.makedirs(output_dir, exist_ok=True)
  names, counts, sizes, digests, fingerprints = [], [], [], [], []
  image_shape = label_shape = None
  done = 0
  for shard, indices in enumerate(np.array_split(order, num_shards)):
    shard_file = shard_name(split, shard, num_shards)
    path = os.path.join(output_dir, shard_file)
    file_op(f"write {shard_file}")
    folded, pending = 0, []
    with tf.io.TFRecordWriter(path) as writer:
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
        record = encode_example(int(i), image, label)
        writer.write(record)
        pending.append(record)
        if len(pending) >= 1024:
          folded ^= int(integrity.fold_fingerprints(pending), 16)
          pending = []
        done += 1
        if progress is not None:
          progress(done, num_examples)
    folded ^= int(integrity.fold_fingerprints(pending), 16)
    file_op(f"close {shard_file}")
    names.append(shard_file)
    counts.append(len(indices))
    sizes.append(os.path.getsize(path))
    digests.append(integrity.file_sha256(path))
    fingerprints.append(f"{folded:016x}")
  sidecar = {"format": FORMAT, "name": name, "split": split, "shards": names,
             "examples_per_shard": counts, "num_examples": int(sum(counts)),
             "image_shape": list(image_shape),
             "label_shape": list(label_shape),
             "class_names": list(class_names), "bytes_per_shard": sizes,
             "sha256_per_shard": digests,
             "fingerprint_per_shard": fingerprints}
  sidecar["generation"] = hashlib.sha256(json.dumps(
      sidecar, sort_keys=True).encode()).hexdigest()[:16]
  path = os.path.join(output_dir, f"{split}.json")
  file_op(f"write {split}.json")
  with open(path + ".tmp", "w") as f:
    json.dump(sidecar, f, indent=1)
  os.replace(path + ".tmp", path)
  return sidecar


def read_sidecar(data_dir, split):
  """The sidecar of `split` in `data_dir` (resolved through its
  `dataset.json`, see framework/data/tfrecord_set.py), checked: its fields,
  and that its shards exist with the sizes it lists (DataError if not)."""
  folder = tfrecord_set.resolve(data_dir)
  path = os.path.join(folder, f"{split}.json")
  try:
    with open(path) as f:
      sidecar = json.load(f)
  except OSError:
    raise DataError(f"data_dir={data_dir!r} is not a distloop TFRecord "
                    f"directory: {path} is missing (write one with "
                    "scripts/make_tfrecords.py)") from None
  except ValueError as e:
    raise DataError(f"{path} is not valid JSON: {e}") from None
  problems = sidecar_schema.problems(sidecar, split)
  if problems:
    raise DataError(f"{path}: {'; '.join(problems)}")
  absent = [s for s in sidecar["shards"]
            if not os.path.isfile(os.path.join(folder, s))]
  if absent:
    raise DataError(f"{path} names shards that are missing: "
                    f"{', '.join(absent[:3])}")
  if "bytes_per_shard" not in sidecar:
    if path not in _WARNED_UNVERIFIED:
      _WARNED_UNVERIFIED.add(path)
      logging.warning("%s has no shard sizes or checksums (an older "
                      "make_tfrecords.py): its shards cannot be verified; "
                      "re-convert to check them", path)
    return sidecar
  for shard, size in zip(sidecar["shards"], sidecar["bytes_per_shard"]):
    actual = os.path.getsize(os.path.join(folder, shard))
    if actual != size:
      raise DataError(
          f"shard {os.path.join(folder, shard)} is damaged: it has {actual} "
          f"bytes, {split}.json lists {size} (truncated, grown or replaced; "
          "re-convert it)")
  return sidecar


def verify(data_dir, split):
  """Checks every shard of `split` against its sidecar's sha256 (reads
  everything); returns the sidecar. DataError naming the first bad shard."""
  sidecar = read_sidecar(data_dir, split)
  folder = tfrecord_set.resolve(data_dir)
  if "sha256_per_shard" not in sidecar:
    raise DataError(f"{os.path.join(folder, split + '.json')} has no "
                    "checksums (written by an older make_tfrecords.py): "
                    "re-convert to verify it")
  for shard, digest in zip(sidecar["shards"], sidecar["sha256_per_shard"]):
    path = os.path.join(folder, shard)
    if integrity.file_sha256(path) != digest:
      raise DataError(f"shard {path} is damaged: its sha256 differs from "
                      f"the one {split}.json lists (re-convert it)")
  return sidecar


def parse_fn(image_shape, label_shape, num_classes=None, where="sidecar"):
  """`serialized -> (index int64, image uint8 [H, W, C], label int32)`.

  A record that does not match `image_shape`, `label_shape` or (if given)
  labels in [0, num_classes) fails the pipeline with a message naming
  `where` (the sidecar) and the example (see framework/data/integrity.py):
  the images are never converted to the sidecar's shape.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  per_pixel = bool(label_shape)
  label_key = "mask" if per_pixel else "label"
  features = {"image": tf.io.FixedLenFeature([], tf.string, ""),
              "index": tf.io.FixedLenFeature([], tf.int64, -1),
              "mask": tf.io.FixedLenFeature([], tf.string, ""),
              "label": tf.io.FixedLenFeature([], tf.int64, -1)}
  check = integrity.check

  def parse(serialized):
    example = tf.io.parse_single_example(serialized, features)
    index = example["index"]
    present = tf.logical_and(
        tf.not_equal(tf.strings.length(example["image"]), 0),
        tf.not_equal(tf.strings.length(example[label_key]), 0)
        if per_pixel else tf.greater_equal(example["label"], 0))
    complete = check(
        tf.logical_and(present, index >= 0), where, ": example ", index,
        f" has no image, index or {label_key} (label_shape is "
        f"{list(label_shape)})")
    with tf.control_dependencies([complete]):
      image = tf.io.decode_png(example["image"])
    shape = tf.shape(image, out_type=tf.int64)
    with tf.control_dependencies([check(
        tf.reduce_all(tf.equal(shape, tf.constant(image_shape, tf.int64))),
        where, ": image_shape is ", str(list(image_shape)), " but example ",
        index, " has shape ", lambda: tf.strings.reduce_join(
            tf.strings.as_string(shape), separator=","))]):
      image = tf.ensure_shape(tf.identity(image), image_shape)
    if per_pixel:
      with tf.control_dependencies([complete]):
        label = tf.cast(tf.io.decode_png(example["mask"], channels=1)[..., 0],
                        tf.int32)
      ok = tf.reduce_all(tf.equal(tf.shape(label, out_type=tf.int64),
                                  tf.constant(label_shape, tf.int64)))
      with tf.control_dependencies([check(
          ok, where, ": example ", index, " has a mask of another shape "
          f"than label_shape {list(label_shape)}")]):
        label = tf.ensure_shape(tf.identity(label), label_shape)
      largest = tf.reduce_max(label)
    else:
      label = tf.cast(example["label"], tf.int32)
      largest = label
    if num_classes is not None:
      with tf.control_dependencies([check(
          largest < num_classes, where, ": class_names has ",
          str(num_classes), " names but example ", index, " has class ",
          largest)]):
        label = tf.identity(label)
    return index, image, label

  return parse


def shard_reader(folder, sidecar):
  """`shard ids (int64 [k]) -> tf.data.Dataset` of the records of those
  shards in `folder`, each counted and fingerprinted as it streams (see
  framework/data/integrity.py)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  paths = tf.constant([os.path.join(folder, s) for s in sidecar["shards"]])
  counts = tf.constant(sidecar["examples_per_shard"], tf.int64)
  fingerprints = None
  if "fingerprint_per_shard" in sidecar:
    fingerprints = tf.constant([integrity.fingerprint_value(v) for v in
                                sidecar["fingerprint_per_shard"]], tf.int64)

  def read(ids):
    return tf.data.Dataset.from_tensor_slices(ids).flat_map(
        lambda i: integrity.checked_shard(
            paths[i], counts[i],
            None if fingerprints is None else fingerprints[i]))

  return read


def read_split_arrays(data_dir, split):
  """(index, images, labels) of a whole split as numpy, in index order (for
  tests and small tools; training streams with `framework.data.file_input`).
  DataError if the split is damaged."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  data_dir = tfrecord_set.resolve(data_dir)
  sidecar = read_sidecar(data_dir, split)
  parse = parse_fn(sidecar["image_shape"], sidecar["label_shape"],
                   len(sidecar["class_names"]), f"{data_dir}/{split}.json")
  records = shard_reader(data_dir, sidecar)(
      tf.range(len(sidecar["shards"]), dtype=tf.int64))
  try:
    rows = list(records.map(parse).as_numpy_iterator())
  except tf.errors.OpError as e:
    raise integrity.data_error(e) or e from None
  index = np.array([int(r[0]) for r in rows])
  order = np.argsort(index)
  images = np.stack([r[1] for r in rows])[order]
  labels = np.stack([r[2] for r in rows])[order]
  return index[order], images, labels
