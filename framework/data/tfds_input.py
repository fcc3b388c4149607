"""TensorFlow Datasets prepared on disk, streamed as a `FileDataset`.

`dataset=tfds:NAME[/CONFIG][:VERSION]` with `data_dir` a TFDS data directory
(`DATA_DIR/NAME[/CONFIG]/VERSION/dataset_info.json` + shards, as written by
`tfds build` or `builder.download_and_prepare`). Nothing is downloaded: a
dataset that is not prepared there is a DataError. Without VERSION (or with
a pattern such as `3.*.*`) the highest prepared version is read.

The builder is opened with `tfds.builder_from_directory`, so the dataset's
own code is never imported. Its TFRecord shards are read directly (the
split's `file_instructions`: path, skip, take) as the shards of a
`framework.data.file_input.ShardedSplit`, so per-pipeline file sharding,
the seeded per-epoch order and exact resume from a step are those of
`--dataset=tfrecord` (see that module). A record's `index` (the seed of its
augmentation) is its position in the split, in shard order.

Features: `image_key` (default 'image') must be an `Image`; `label_key`
(default 'label') a `ClassLabel` (classification; class names from it) or a
one-channel `Image` (a segmentation mask; Oxford-IIIT Pet's trimap values
1..3 become classes 0..2 as for `--dataset=oxford_pet`, another mask needs
`mask_classes`). Images of undefined size are resized to `image_size`
squared (bilinear; masks nearest); images of a fixed size are read as is.
Other features are not decoded.
"""

import fnmatch
import os
import re

from framework.errors import ConfigError, DataError
from framework.data.config import DatasetOptions
from framework.settings import default

INSTALL = 'pip install -e ".[tfds]"'
_VERSION = re.compile(r"\d+\.\d+\.\d+")
# Trimap values 1, 2, 3 become classes 0, 1, 2 (as framework.data.segmentation_data).
_KNOWN_MASKS = {("oxford_iiit_pet", "segmentation_mask"):
                (1, ("pet", "background", "border"))}


def import_tfds(spec):
  """The `tensorflow_datasets` module, or a one-line ConfigError."""
  try:
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ConfigError(f"dataset=tfds:{spec} needs TensorFlow Datasets, which "
                      f"is not installed: {INSTALL}") from None
  return tfds


def parse_spec(spec):
  """'NAME[/CONFIG][:VERSION]' -> ('NAME[/CONFIG]', VERSION or None)."""
  name, _, version = spec.partition(":")
  if not re.fullmatch(r"[a-z0-9_]+(/[A-Za-z0-9_.-]+)?", name) or (
      version and not re.fullmatch(r"[0-9*]+\.[0-9*]+\.[0-9*]+", version)):
    raise ConfigError(f"dataset=tfds:{spec} is not tfds:NAME[/CONFIG]"
                      "[:VERSION] (e.g. tfds:mnist, tfds:oxford_iiit_pet:"
                      "4.*.*)")
  return name, version or None


def builder_dir(data_dir, name, version):
  """DATA_DIR/NAME[/CONFIG]/VERSION of the highest matching prepared version."""
  base = os.path.join(data_dir, *name.split("/"))
  prepared = sorted(
      (d for d in (os.listdir(base) if os.path.isdir(base) else ())
       if _VERSION.fullmatch(d) and
       os.path.isfile(os.path.join(base, d, "dataset_info.json"))),
      key=lambda d: tuple(int(p) for p in d.split(".")))
  matching = [d for d in prepared
              if version is None or fnmatch.fnmatch(d, version)]
  if not matching:
    found = f"it has versions {', '.join(prepared)}" if prepared else (
        f"{base} holds no prepared version (VERSION/dataset_info.json)")
    raise DataError(
        f"TFDS dataset {name}{':' + version if version else ''} is not "
        f"prepared under data_dir={data_dir!r}: {found}. Prepare it first "
        f"(e.g. `tfds build {name} --data_dir={data_dir}`); distloop never "
        "downloads")
  return os.path.join(base, matching[-1])


def _split(tfds, builder, split, decode):
  """A `ShardedSplit` over the TFRecord shards of `split`."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from framework.data import file_input  # pylint: disable=g-import-not-at-top
  instructions = [i for i in builder.info.splits[split].file_instructions
                  if i.take]
  takes = [int(i.take) for i in instructions]
  paths = tf.constant([os.fspath(i.filename) for i in instructions])
  skips = tf.constant([int(i.skip) for i in instructions], tf.int64)
  sizes = tf.constant(takes, tf.int64)
  starts = tf.constant(np.cumsum([0] + takes[:-1]), tf.int64)
  del tfds

  def shard(s):
    records = tf.data.TFRecordDataset(paths[s]).skip(skips[s]).take(sizes[s])
    # A dict, not a tuple: FileDataset maps records as one argument.
    return records.enumerate(starts[s]).map(
        lambda i, r: {"index": i, "record": r})

  def read(ids):
    return tf.data.Dataset.from_tensor_slices(ids).flat_map(shard)

  return file_input.ShardedSplit(
      tuple(takes), read, lambda r: (r["index"],) + decode(r["record"]),
      lambda records: records["index"])


def _decoder(tfds, features, name, image_key, label_key, image_size,
             mask_classes):
  """(decode: serialized -> (image, label), image shape, label shape, classes)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  keys = sorted(features.keys())
  for option, key in (("image_key", image_key), ("label_key", label_key)):
    if key not in features:
      raise ConfigError(f"{option}={key!r} is not a feature of TFDS dataset "
                        f"{name}; its features: {', '.join(keys)}")
  image = features[image_key]
  if not isinstance(image, tfds.features.Image) or image.tf_dtype != tf.uint8:
    raise DataError(f"feature {image_key!r} of {name} is {image}, not a uint8 "
                    "Image (set image_key)")
  height, width, channels = image.shape
  if channels is None:
    raise DataError(f"feature {image_key!r} of {name} has no fixed channel "
                    "count")
  resize = height is None or width is None
  if resize and not image_size:
    raise ConfigError(f"images of {name} have no fixed size: give "
                      "image_size to resize them")
  size = (image_size, image_size) if resize else (height, width)
  label = features[label_key]
  if isinstance(label, tfds.features.ClassLabel):
    classes, label_shape, offset = tuple(label.names), (), 0
  elif isinstance(label, tfds.features.Image) and label.shape[-1] == 1:
    label_shape = size
    if label.shape[:2] != (height, width) and not resize:
      raise DataError(f"mask {label_key!r} of {name} is {label.shape[:2]}, "
                      f"its images {height, width}")
    known = _KNOWN_MASKS.get((name.split("/")[0], label_key))
    if mask_classes:
      classes, offset = tuple(mask_classes), 0
    elif known:
      offset, classes = known
    else:
      raise ConfigError(f"label_key={label_key!r} of {name} is a mask: give "
                        "mask_classes (the class names of its values 0..K-1)")
  else:
    raise DataError(f"feature {label_key!r} of {name} is {label}: a label "
                    "must be a ClassLabel or a one-channel Image mask (set "
                    "label_key)")
  # Features other than the image and the label are parsed, not decoded.
  skip = {k: tfds.decode.SkipDecoding() for k in keys
          if k not in (image_key, label_key)}

  def decode(serialized):
    example = features.deserialize_example(serialized, decoders=skip)
    x, y = example[image_key], example[label_key]
    if resize:
      x = tf.cast(tf.round(tf.clip_by_value(
          tf.image.resize(x, size), 0, 255)), tf.uint8)
    x = tf.ensure_shape(x, size + (channels,))
    if label_shape:
      if resize:
        y = tf.image.resize(y, size, method="nearest")
      y = tf.ensure_shape(tf.cast(y[..., 0], tf.int32) - offset, label_shape)
    else:
      y = tf.cast(y, tf.int32)
    return x, y

  return decode, size + (channels,), label_shape, classes


def load_tfds(spec, data_dir, *, image_key=default(DatasetOptions, "image_key"),
              label_key=default(DatasetOptions, "label_key"),
              image_size=None, mask_classes=None, train_split="train",
              test_split=None, shards_per_group=None,
              file_shuffle=default(DatasetOptions, "file_shuffle")):
  """The `FileDataset` of TFDS dataset `spec` prepared under `data_dir`."""
  from framework.data import file_input  # pylint: disable=g-import-not-at-top
  if not spec:
    raise ConfigError("dataset=tfds needs a name: tfds:NAME[/CONFIG]"
                      "[:VERSION]")
  name, version = parse_spec(spec)
  if not data_dir:
    raise ConfigError(f"dataset=tfds:{spec} needs data_dir (the TFDS data "
                      "directory it was prepared in)")
  path = builder_dir(data_dir, name, version)
  tfds = import_tfds(spec)
  try:
    builder = tfds.builder_from_directory(path)
  except Exception as e:  # pylint: disable=broad-except
    first = (str(e).strip() or type(e).__name__).splitlines()[0]
    raise DataError(f"cannot open the TFDS dataset in {path}: {first}") \
        from None
  file_format = str(getattr(builder.info, "file_format", "tfrecord"))
  if "tfrecord" not in file_format.lower():
    raise DataError(f"{path} is stored as {file_format}; distloop reads TFDS "
                    "datasets in TFRecord format (tfds build --file_format="
                    "tfrecord)")
  splits = builder.info.splits
  if test_split is None:
    test_split = next((s for s in ("test", "validation") if s in splits),
                      "test")
  for option, split in (("train_split", train_split),
                        ("test_split", test_split)):
    if split not in splits:
      raise ConfigError(f"{option}={split!r} is not a split of {name} in "
                        f"{path}; its splits: {', '.join(sorted(splits))}")
  decode, image_shape, label_shape, classes = _decoder(
      tfds, builder.info.features, name, image_key, label_key, image_size,
      mask_classes)
  kwargs = {} if shards_per_group is None else dict(
      shards_per_group=shards_per_group)
  return file_input.FileDataset(
      f"tfds:{name}", _split(tfds, builder, train_split, decode),
      _split(tfds, builder, test_split, decode), class_names=classes,
      image_shape=image_shape, label_shape=label_shape, shuffle=file_shuffle,
      **kwargs)


def _register():
  from framework.data import datasets  # pylint: disable=g-import-not-at-top

  def load(spec="", data_dir=None, image_size=None, **options):
    options.pop("seed", None)
    return load_tfds(spec, data_dir, image_size=image_size, **options)

  datasets.DATASETS["tfds"] = load


_register()
