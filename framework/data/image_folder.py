"""Image folders in Keras's `image_dataset_from_directory` layout.

    root/train/<class_name>/*.png|jpg ...   and   root/test/<class_name>/...
    or  root/<class_name>/*.png|jpg ...     (test: a seeded fraction)

Class names are the sorted sub-folder names; an example's `index` is its
position in the split's files sorted by (class, file name). `scan` lists the
files (the converter reads them with PIL); `load_image_folder` streams them
for training as a `framework.data.file_input.FileDataset` whose shards are
fixed groups of files (the files are dealt to them in a seeded order, so
each shard holds every class).
"""

import os

import numpy as np

from framework.errors import ConfigError, DataError, check_positive
from framework.data.config import DatasetOptions, InputConfig
from framework.settings import default

EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif")
DEFAULT_TEST_FRACTION = 0.2
FILES_PER_SHARD = 256


def _class_files(split_dir):
  """(class names, [(path, label)]) of one split directory."""
  classes = sorted(d for d in os.listdir(split_dir)
                   if os.path.isdir(os.path.join(split_dir, d)))
  if not classes:
    raise DataError(f"{split_dir} has no class sub-folders (expected "
                    "<class_name>/*.png|jpg)")
  files = []
  for label, name in enumerate(classes):
    folder = os.path.join(split_dir, name)
    images = sorted(f for f in os.listdir(folder)
                    if f.lower().endswith(EXTENSIONS))
    if not images:
      raise DataError(f"class folder {folder} has no images (expected "
                      f"{', '.join(EXTENSIONS)} files)")
    files += [(os.path.join(folder, f), label) for f in images]
  return classes, files


def scan(root, test_fraction=DEFAULT_TEST_FRACTION,
         seed=default(InputConfig, "seed")):
  """(class_names, {"train": [(path, label)], "test": [...]}) of `root`.

  With `root/train` and `root/test`, those are the splits (their class
  folders must agree); otherwise a seeded `test_fraction` of the files is
  the test split.
  """
  if not root or not os.path.isdir(root):
    raise DataError(f"data_dir={root!r} is not a directory (expected an "
                    "image folder: <class_name>/*.png|jpg, or train/ and "
                    "test/ holding those)")
  train_dir, test_dir = (os.path.join(root, s) for s in ("train", "test"))
  if os.path.isdir(train_dir) and os.path.isdir(test_dir):
    classes, train = _class_files(train_dir)
    test_classes, test = _class_files(test_dir)
    if test_classes != classes:
      raise DataError(f"{train_dir} and {test_dir} have different class "
                      f"folders: {classes} vs {test_classes}")
    return classes, {"train": train, "test": test}
  if not 0 < test_fraction < 1:
    raise ConfigError(f"test_fraction={test_fraction!r} must be in (0, 1)")
  classes, files = _class_files(root)
  order = np.random.default_rng(seed).permutation(len(files))
  num_test = max(1, int(round(len(files) * test_fraction)))
  if num_test >= len(files):
    raise DataError(f"data_dir={root!r} has {len(files)} images: too few to "
                    f"split off a test fraction of {test_fraction}")
  test_ids = set(order[:num_test].tolist())
  return classes, {
      "train": [f for i, f in enumerate(files) if i not in test_ids],
      "test": [f for i, f in enumerate(files) if i in test_ids]}


def read_image(path, image_size=None):
  """uint8 [H, W, 3] (RGB), resized bilinearly to a square `image_size`."""
  from PIL import Image  # pylint: disable=g-import-not-at-top
  try:
    with Image.open(path) as image:
      image = image.convert("RGB")
      if image_size:
        image = image.resize((image_size, image_size), Image.BILINEAR)
      return np.asarray(image)
  except (OSError, ValueError) as e:
    raise DataError(f"cannot read image {path}: {e}") from None


def image_shape(path):
  """(H, W, 3) from the file's header, without decoding it."""
  from PIL import Image  # pylint: disable=g-import-not-at-top
  try:
    with Image.open(path) as image:
      width, height = image.size
  except (OSError, ValueError) as e:
    raise DataError(f"cannot read image {path}: {e}") from None
  return (height, width, 3)


def _split(files, shape, files_per_shard):
  """A `ShardedSplit` over files: records are positions in a shuffled list."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from framework.data import file_input  # pylint: disable=g-import-not-at-top
  order = np.random.default_rng(0).permutation(len(files))
  paths = tf.constant([files[i][0] for i in order])
  labels = tf.constant([files[i][1] for i in order], tf.int32)
  index = tf.constant(order, tf.int64)
  counts = [len(c) for c in np.array_split(
      order, -(-len(files) // files_per_shard))]
  starts = tf.constant(np.cumsum([0] + counts[:-1]), tf.int64)
  sizes = tf.constant(counts, tf.int64)

  def read(ids):
    return tf.data.Dataset.from_tensor_slices(ids).flat_map(
        lambda s: tf.data.Dataset.range(starts[s], starts[s] + sizes[s]))

  def decode(position):
    contents = tf.io.read_file(paths[position])
    with tf.control_dependencies([_check_complete(contents,
                                                  paths[position])]):
      image = tf.io.decode_image(contents, channels=3,
                                 expand_animations=False)
    return index[position], tf.ensure_shape(image, shape), labels[position]

  return file_input.ShardedSplit(tuple(counts), read, decode,
                                lambda positions: tf.gather(index, positions))


def _check_complete(contents, path):
  """Fails, naming `path`, on a JPEG cut short: no end-of-image marker in
  its last KiB (the decoder's own error would not name the file)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from framework.data import integrity  # pylint: disable=g-import-not-at-top
  size = tf.strings.length(contents)
  is_jpeg = tf.equal(tf.strings.substr(contents, 0, 3), b"\xff\xd8\xff")
  tail_start = tf.maximum(size - 1024, 0)
  tail = tf.strings.substr(contents, tail_start, size - tail_start)
  has_end = tf.size(tf.strings.split(tail, sep=b"\xff\xd9")) > 1
  return integrity.check(
      tf.logical_or(tf.logical_not(is_jpeg), has_end),
      "cannot read image ", path, ": it is truncated (no JPEG end marker; "
      "re-save or remove it)")


def load_image_folder(data_dir, files_per_shard=FILES_PER_SHARD,
                      test_fraction=DEFAULT_TEST_FRACTION,
                      shuffle=default(DatasetOptions, "file_shuffle")):
  """A `FileDataset` streaming an image folder (all images one shape);
  `shuffle` as for `FileDataset`."""
  from framework.data import file_input  # pylint: disable=g-import-not-at-top
  check_positive("files_per_shard", files_per_shard)
  if not data_dir:
    raise ConfigError("dataset=image_folder needs data_dir (the folder "
                      "holding <class_name>/ sub-folders)")
  classes, splits = scan(data_dir, test_fraction)
  shapes = {}
  for path, _ in splits["train"] + splits["test"]:
    shapes.setdefault(image_shape(path), path)
  if len(shapes) > 1:
    (a, path_a), (b, path_b) = list(shapes.items())[:2]
    raise DataError(
        f"images of different sizes in {data_dir}: {path_a} is {a[:2]}, "
        f"{path_b} is {b[:2]}; convert them to one size with "
        "scripts/make_tfrecords.py --dataset=image_folder --image_size=N and "
        "train with --dataset=tfrecord")
  shape = next(iter(shapes))
  return file_input.FileDataset(
      "image_folder", _split(splits["train"], shape, files_per_shard),
      _split(splits["test"], shape, files_per_shard), class_names=classes,
      image_shape=shape, shuffle=shuffle)


def _register():
  from framework.data import datasets  # pylint: disable=g-import-not-at-top
  datasets.DATASETS["image_folder"] = (
      lambda data_dir=None, file_shuffle=default(
          DatasetOptions, "file_shuffle"), **_: load_image_folder(
              data_dir, shuffle=file_shuffle))


_register()
