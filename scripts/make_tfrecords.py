"""Writes a dataset as sharded TFRecords that `--dataset=tfrecord` streams.

    python scripts/make_tfrecords.py --dataset=cifar10 \
        --data_dir=../shared/data/cifar10/cifar-10-batches-py \
        --output_dir=/tmp/cifar10_tfrecords --num_shards=16
    python scripts/make_tfrecords.py --dataset=image_folder --data_dir=photos \
        --output_dir=/tmp/photos --image_size=96
    python scripts/make_tfrecords.py --dataset=synthetic --synthetic_train=200000 \
        --synthetic_shape=64,64,3 --output_dir=/tmp/big

Output: `train-*-of-*.tfrecord`, `test-*-of-*.tfrecord`, `train.json` and
`test.json` (see framework/data/tfrecords.py). Everything is written to a staging
folder beside --output_dir and moved in at the end, so bad input (reported in
one line) leaves --output_dir as it was.
"""

import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app  # pylint: disable=g-import-not-at-top
try:  # Installed: the package distloop_cli.
  from . import cli  # pylint: disable=g-import-not-at-top
except ImportError:  # python scripts/<app>.py
  from scripts import cli  # pylint: disable=g-import-not-at-top
cli.quiet_startup()  # Before TensorFlow is imported.
from absl import flags
from absl import logging
import numpy as np

FLAGS = flags.FLAGS
flags.DEFINE_enum("dataset", None, ["cifar10", "oxford_pets", "shapes",
                                    "synthetic", "image_folder"],
                  "What to convert.")
flags.DEFINE_string("data_dir", None, "Source: the CIFAR-10 python folder, "
                    "the Oxford-IIIT Pet folder, or the image folder "
                    "(<class>/*.png|jpg, or train/ and test/ holding those).")
flags.DEFINE_string("output_dir", None, "Where the shards and sidecars go.")
flags.DEFINE_integer("num_shards", 16, "Shards per split (at least the "
                     "number of workers, to shard by file).")
flags.DEFINE_integer("image_size", None, "Resize images to this square side "
                     "(image_folder: required when sizes differ; shapes, "
                     "oxford_pets: default 128).")
flags.DEFINE_float("test_fraction", 0.2, "image_folder without train/ and "
                   "test/: the seeded fraction of files that is the test "
                   "split.")
flags.DEFINE_integer("synthetic_train", 2048, "synthetic: training examples.")
flags.DEFINE_integer("synthetic_test", 512, "synthetic: test examples.")
flags.DEFINE_list("synthetic_shape", ["32", "32", "3"], "synthetic: image "
                  "shape H,W,C.")
flags.DEFINE_integer("synthetic_classes", 10, "synthetic: classes.")
flags.DEFINE_integer("seed", 0, "synthetic and shapes: generator seed; all: "
                     "the order examples are dealt to shards.")
flags.mark_flags_as_required(["dataset", "output_dir"])
for _name in ("num_shards", "image_size", "synthetic_train", "synthetic_test",
              "synthetic_classes"):
  flags.register_validator(_name, lambda v: v is None or v > 0,
                           message=f"--{_name} must be a positive integer")


class _Progress:
  """Logs every 10% of a split (a long conversion shows it is alive)."""

  def __init__(self, split):
    self.split = split
    self.reported = 0

  def __call__(self, done, total):
    tenth = done * 10 // total
    if tenth > self.reported:
      self.reported = tenth
      logging.info("%s: %d/%d examples (%d%%)", self.split, done, total,
                   tenth * 10)


def _arrays(data):
  """{split: (get_example, count)} of an in-memory ArrayDataset."""
  return {"train": (lambda i: (data.train_x[i], data.train_y[i]),
                    len(data.train_x)),
          "test": (lambda i: (data.test_x[i], data.test_y[i]),
                   len(data.test_x))}, data.class_names


def _synthetic():
  """Class prototype + noise, example i from its own seed: any size streams
  (not the same pixels as train.py's in-memory --dataset=synthetic)."""
  from framework.errors import ConfigError  # pylint: disable=g-import-not-at-top
  try:
    shape = tuple(int(v) for v in FLAGS.synthetic_shape)
  except ValueError:
    shape = ()
  if len(shape) != 3 or min(shape) <= 0:
    raise ConfigError(f"synthetic_shape={','.join(FLAGS.synthetic_shape)} "
                      "must be three positive integers H,W,C")
  classes = FLAGS.synthetic_classes
  prototypes = np.random.default_rng(FLAGS.seed).uniform(
      40, 215, size=(classes,) + shape).astype(np.float32)

  def getter(split_id):
    def get(i):
      rng = np.random.default_rng([FLAGS.seed, split_id, i])
      label = int(rng.integers(classes))
      noise = rng.normal(0, 40, size=shape).astype(np.float32)
      return np.clip(prototypes[label] + noise, 0, 255).astype(np.uint8), label
    return get

  return {"train": (getter(0), FLAGS.synthetic_train),
          "test": (getter(1), FLAGS.synthetic_test)}, tuple(
              f"class_{i}" for i in range(classes))


def _image_folder():
  from framework.data import image_folder  # pylint: disable=g-import-not-at-top
  from framework.errors import DataError  # pylint: disable=g-import-not-at-top
  classes, splits = image_folder.scan(FLAGS.data_dir, FLAGS.test_fraction,
                                      seed=FLAGS.seed)
  if not FLAGS.image_size:
    # Headers only: a mixed folder fails before anything is written.
    seen = {}
    for path, _ in splits["train"] + splits["test"]:
      seen.setdefault(image_folder.image_shape(path), path)
      if len(seen) > 1:
        (a, path_a), (b, path_b) = list(seen.items())
        raise DataError(f"images of different sizes: {path_a} is "
                        f"{a[0]}x{a[1]}, {path_b} is {b[0]}x{b[1]}; pass "
                        "--image_size=N to resize them all to NxN")
  out = {}
  for split, files in splits.items():
    out[split] = ((lambda i, files=files: (
        image_folder.read_image(files[i][0], FLAGS.image_size),
        files[i][1])), len(files))
  return out, classes


def _sources():
  from framework.data import datasets, segmentation_data  # pylint: disable=g-import-not-at-top
  name = FLAGS.dataset
  if name == "cifar10":
    return _arrays(datasets.load_cifar10(FLAGS.data_dir))
  if name == "oxford_pets":
    return _arrays(segmentation_data.load_oxford_pet(
        FLAGS.data_dir, image_size=FLAGS.image_size or 128))
  if name == "shapes":
    return _arrays(segmentation_data.shapes(
        image_size=FLAGS.image_size or 128, seed=FLAGS.seed))
  if name == "synthetic":
    return _synthetic()
  return _image_folder()


def convert():
  from framework.data import tfrecords  # pylint: disable=g-import-not-at-top
  sources, class_names = _sources()
  output_dir = os.path.abspath(FLAGS.output_dir)
  parent = os.path.dirname(output_dir)
  os.makedirs(parent, exist_ok=True)
  staging = tempfile.mkdtemp(prefix=".make_tfrecords-", dir=parent)
  try:
    for split in tfrecords.SPLITS:
      get_example, count = sources[split]
      logging.info("writing %s: %d examples in %d shards", split, count,
                   min(FLAGS.num_shards, count))
      sidecar = tfrecords.write_split(
          staging, split, get_example, count, num_shards=FLAGS.num_shards,
          class_names=class_names, name=FLAGS.dataset, shuffle_seed=FLAGS.seed,
          progress=_Progress(split))
    os.makedirs(output_dir, exist_ok=True)
    for name in sorted(os.listdir(staging)):
      os.replace(os.path.join(staging, name), os.path.join(output_dir, name))
  finally:
    shutil.rmtree(staging, ignore_errors=True)
  logging.info("wrote %s: image shape %s, %d classes", output_dir,
               sidecar["image_shape"], len(class_names))


main = cli.main_running(convert)


def entry():
  """Console entry point `distloop-make-tfrecords`."""
  cli.run_entry_point(main, __name__)


if __name__ == "__main__":
  app.run(main)
