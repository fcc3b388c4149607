"""Writes a dataset as sharded TFRecords that `--dataset=tfrecord` streams.

    python scripts/make_tfrecords.py --dataset=cifar10 \
        --data_dir=../shared/data/cifar10/cifar-10-batches-py \
        --output_dir=/tmp/cifar10_tfrecords --num_shards=16
    python scripts/make_tfrecords.py --dataset=image_folder --data_dir=photos \
        --output_dir=/tmp/photos --image_size=96
    python scripts/make_tfrecords.py --dataset=synthetic --synthetic_train=200000 \
        --synthetic_shape=64,64,3 --output_dir=/tmp/big

    python scripts/make_tfrecords.py --verify=/tmp/cifar10_tfrecords

Output: `train-*-of-*.tfrecord`, `test-*-of-*.tfrecord`, `train.json` and
`test.json` (see framework/data/tfrecords.py) in a generation folder of
--output_dir, published by `dataset.json` (framework/data/tfrecord_set.py):
everything is written to a staging folder and made current by one rename,
so a reader sees the previous set or the new one, and bad input, a full disk
or a killed converter leave --output_dir's current set as it was. Staging
folders of converters that died on this host are removed on the next run.
--verify checks every shard's sha256 against its sidecar.
"""

import errno
import hashlib
import os
import shutil
import signal

from absl import app  # pylint: disable=g-import-not-at-top
try:  # Installed: the package distloop_cli.
  from . import cli  # pylint: disable=g-import-not-at-top
except ImportError:  # python scripts/<app>.py
  from distloop_cli import cli  # pylint: disable=g-import-not-at-top
cli.quiet_startup()  # Before TensorFlow is imported.
from absl import flags
from absl import logging
import numpy as np

from framework.data.config import InputConfig  # pylint: disable=g-import-not-at-top
from framework.settings import default  # pylint: disable=g-import-not-at-top

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
flags.DEFINE_integer("seed", default(InputConfig, "seed"), "synthetic and "
                     "shapes: generator seed; all: "
                     "the order examples are dealt to shards.")
flags.DEFINE_string("verify", None, "Instead of converting: check every "
                    "shard of this TFRecord folder against the sha256 its "
                    "sidecar lists.")
# Test hook: SIGKILL this process before its k-th file operation.
KILL_AT_ENV = "DISTLOOP_MAKE_TFRECORDS_KILL_AT"
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


class _FileOps:
  """Counts the converter's file operations; with KILL_AT_ENV=k set, the
  process SIGKILLs itself before the k-th (a test of the publish)."""

  def __init__(self):
    self.count = 0
    self.kill_at = int(os.environ.get(KILL_AT_ENV) or 0)

  def __call__(self, what):
    self.count += 1
    logging.debug("file operation %d: %s", self.count, what)
    if self.count == self.kill_at:
      os.kill(os.getpid(), signal.SIGKILL)


def _check_output_dir(output_dir):
  """ConfigError, before anything is converted, unless `output_dir` is or
  can be a writable folder."""
  from framework.errors import ConfigError  # pylint: disable=g-import-not-at-top
  if os.path.lexists(output_dir) and not os.path.isdir(output_dir):
    raise ConfigError(f"output_dir={FLAGS.output_dir!r} is a file, not a "
                      "folder")
  existing = output_dir
  while not os.path.isdir(existing):
    parent = os.path.dirname(existing)
    if os.path.lexists(parent) and not os.path.isdir(parent):
      raise ConfigError(f"output_dir={FLAGS.output_dir!r} is under "
                        f"{parent}, which is a file")
    existing = parent
  if not os.access(existing, os.W_OK | os.X_OK):
    raise ConfigError(f"output_dir={FLAGS.output_dir!r} cannot be written "
                      f"({existing} is not writable)")


def _write_error(error, output_dir):
  """The DataError line of a failed write (a full disk: ENOSPC, or
  TensorFlow's ResourceExhaustedError)."""
  from framework.errors import DataError  # pylint: disable=g-import-not-at-top
  code = getattr(error, "errno", None)
  reason = os.strerror(code) if code else str(error).strip().splitlines()[0]
  if "resource" in type(error).__name__.lower() or code == errno.ENOSPC:
    reason = f"no space left: {reason}"
  return DataError(f"cannot write {output_dir} ({reason}); its current "
                   "set is unchanged")


def verify():
  from framework.data import tfrecord_set, tfrecords  # pylint: disable=g-import-not-at-top
  from framework.errors import DataError  # pylint: disable=g-import-not-at-top
  data_dir = os.path.abspath(FLAGS.verify)
  if not os.path.isdir(data_dir):
    raise DataError(f"verify={FLAGS.verify!r} is not a folder")
  for split in tfrecords.SPLITS:
    sidecar = tfrecords.verify(data_dir, split)
    logging.info("%s: %d shards, %d examples: sha256 as listed", split,
                 len(sidecar["shards"]), sidecar["num_examples"])
  print(f"verified {tfrecord_set.resolve(data_dir)}: every shard matches "
        "its sidecar")


def convert():
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from framework.data import tfrecord_set, tfrecords  # pylint: disable=g-import-not-at-top
  from framework.errors import ConfigError  # pylint: disable=g-import-not-at-top
  if FLAGS.verify:
    return verify()
  if not FLAGS.dataset or not FLAGS.output_dir:
    raise ConfigError("--dataset and --output_dir are required (or "
                      "--verify=DIR to check a converted folder)")
  output_dir = os.path.abspath(FLAGS.output_dir)
  _check_output_dir(output_dir)
  for path in tfrecord_set.remove_stale_staging(
      output_dir, os.path.dirname(output_dir)):
    logging.info("removed %s (left by a converter that died)", path)
  sources, class_names = _sources()
  file_op = _FileOps()
  created = not os.path.isdir(output_dir)
  staging = None
  try:
    os.makedirs(output_dir, exist_ok=True)
    file_op("create staging folder")
    staging = tfrecord_set.make_staging(output_dir)
    generations = []
    for split in tfrecords.SPLITS:
      get_example, count = sources[split]
      logging.info("writing %s: %d examples in %d shards", split, count,
                   min(FLAGS.num_shards, count))
      sidecar = tfrecords.write_split(
          staging, split, get_example, count, num_shards=FLAGS.num_shards,
          class_names=class_names, name=FLAGS.dataset, shuffle_seed=FLAGS.seed,
          progress=_Progress(split), file_op=file_op)
      generations.append(sidecar["generation"])
    generation = hashlib.sha256("/".join(generations).encode()).hexdigest()
    folder = tfrecord_set.publish(staging, output_dir, generation[:16],
                                  file_op)
    staging = None
  except (OSError, tf.errors.OpError) as e:
    raise _write_error(e, output_dir) from None
  finally:
    if staging is not None:
      shutil.rmtree(staging, ignore_errors=True)
    if created and os.path.isdir(output_dir) and not os.listdir(output_dir):
      os.rmdir(output_dir)
  logging.info("wrote %s: image shape %s, %d classes", folder,
               sidecar["image_shape"], len(class_names))


main = cli.main_running(convert)


def entry():
  """Console entry point `distloop-make-tfrecords`."""
  cli.run_entry_point(main, __name__)


if __name__ == "__main__":
  app.run(main)
