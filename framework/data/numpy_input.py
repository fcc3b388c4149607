"""`--dataset=numpy`: your own arrays of any shape, streamed from disk.

`data_dir` is an `.npz` file holding `x_train`, `y_train`, `x_test`,
`y_test` (and optionally `class_names`), or a folder of those `.npy` files.
Without `y_train` and `y_test` the data is unlabeled: batches are the
features alone, no classes, for a trainer whose `compute_loss` needs no
labels (`Trainer.task = "custom"`: an autoencoder, a VAE). Float `y_*` are
targets (regression), passed on as float32 in their own shape, for such a
trainer too (the model function's `num_classes` is then the targets' last
dimension, 1 for [examples]; 0 for unlabeled data); integer `y_*` are class
indices.
The arrays are memory-mapped (`np.load(mmap_mode="r")`; the members of an
uncompressed `.npz` in place), and each input pipeline gathers only the rows
of its own replicas' batches: no process copies a whole array, and the page
cache is shared by the workers of one host. A compressed `.npz`
(`np.savez_compressed`) cannot be mapped and is read into memory once per
process, with a warning.

What is mapped is checked first: every array's stored bytes must be exactly
what its header's shape and dtype need (a header listing more rows than
stored would map neighbouring bytes), and an `.npz`'s members must match
their CRC-32s; that pass reads the whole file, so it is done once and
recorded outside the data folder (`integrity.record_checked`) until the file
changes. Labels of shape [examples, 1] are class indices like [examples].
Without `class_names` the class count is the largest label + 1, unless that
is far beyond the number of distinct labels (a stray label would build a
model of that many classes): then the label is named in a DataError.

Batches are the same pure function of (seed, step) as for in-memory arrays
(`framework.data.inputs`), so a resumed run gets exactly the batches an
uninterrupted one would, and the same batches as the same arrays in memory.
Features are scaled by the input pipeline like every dataset's
(`inputs.to_float`: uint8 divided by 255, floats as they are). `CONTRACT`
says it all in one line: the `--dataset` flag's help, docs/guide/data.md and
every error about a bad file say the same.
"""

import os
import struct
import zipfile
import zlib

from absl import logging
import numpy as np
import tensorflow as tf

from framework.data import inputs, integrity
from framework.data.datasets import ArraySplits
from framework.data.config import InputConfig
from framework.errors import DataError, check_positive, first_line
from framework.settings import default

KEYS = ("x_train", "y_train", "x_test", "y_test")
FEATURE_KEYS = ("x_train", "x_test")
LABEL_KEYS = ("y_train", "y_test")
CLASS_NAMES_KEY = "class_names"
_CRC_CHECK = "npz-crc32"
# Without class_names, a largest label + 1 above _SPREAD times the number of
# distinct labels + _SLACK is a stray value, not classes the data lacks.
_SPREAD, _SLACK = 2, 16
# The data contract, appended to every error about the arrays.
CONTRACT = ("x_train, x_test: numbers of shape [examples, ...] (e.g. "
            "[N, 28, 28, 1]), uint8 divided by 255 to [0, 1], any other "
            "dtype reaching the model as float32 as given; y_train, y_test: "
            "integer class indices 0..classes-1 of shape [examples] or "
            "[examples, 1] (or [examples, height, width] masks), float targets "
            "of any shape, or both absent (unlabeled data, for a trainer "
            "with task='custom'); class_names: optional strings")


def _contract_error(message):
  """DataError of `message` followed by the data contract."""
  return DataError(f"{message} (dataset=numpy: {CONTRACT})")


def _read_header(f):
  """(shape, fortran_order, dtype) of the `.npy` header at `f`'s position,
  leaving `f` at the array's first byte."""
  version = np.lib.format.read_magic(f)
  read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                 else np.lib.format.read_array_header_2_0)
  return read_header(f)


def _check_size(where, shape, dtype, stored):
  """DataError unless `stored` bytes are exactly the data of the header's
  `shape` and `dtype` (fewer: a header listing more rows than stored, whose
  mapping would read neighbouring bytes; more: bytes no header describes)."""
  wanted = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
  if stored != wanted:
    raise DataError(
        f"{where} is damaged: its header lists shape {tuple(shape)} of "
        f"{dtype} ({wanted} bytes of data) but it stores {stored} bytes "
        "(truncated, or a wrong header; save it again with np.save/np.savez)")


def _npy_file(path, key):
  """The `.npy` file `path` memory-mapped, its size checked against its
  header."""
  with open(path, "rb") as f:
    shape, _, dtype = _read_header(f)
    offset = f.tell()
  if not dtype.hasobject:
    _check_size(f"data_dir={os.path.dirname(path)!r}: {key}.npy", shape, dtype,
                os.path.getsize(path) - offset)
  return np.load(path, allow_pickle=False, mmap_mode="r")


def _npz_member(path, key):
  """The `.npz` member `key` memory-mapped in place (None if compressed),
  its size checked against its header."""
  with zipfile.ZipFile(path) as archive:
    info = archive.getinfo(key + ".npy")
  if info.compress_type != zipfile.ZIP_STORED:
    return None
  with open(path, "rb") as f:
    f.seek(info.header_offset)
    local = f.read(30)  # the member's local header: its own name and extra
    name_len, extra_len = struct.unpack("<HH", local[26:30])
    start = info.header_offset + 30 + name_len + extra_len
    f.seek(start)
    shape, fortran, dtype = _read_header(f)
    offset = f.tell()
  if dtype.hasobject:
    raise DataError(f"data_dir={path!r}: {key} holds Python objects; save "
                    "numeric arrays")
  _check_size(f"data_dir={path!r}: member {key}.npy", shape, dtype,
              info.file_size - (offset - start))
  if not shape or 0 in shape:
    # np.memmap cannot map 0 bytes; such a split is refused below anyway.
    return np.zeros(shape, dtype)
  return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape,
                   order="F" if fortran else "C")


def _check_crcs(path, keys):
  """DataError unless the `.npz` members of `keys` match their CRC-32s.

  A memory-mapped member bypasses zipfile's own check, so each is read
  through zipfile once; the pass is recorded (`integrity.record_checked`)
  and not repeated while the file keeps its size, mtime and inode.
  """
  if integrity.checked_before(path, _CRC_CHECK):
    return
  identity = integrity.file_identity(path)
  with zipfile.ZipFile(path) as archive:
    for key in keys:
      try:
        with archive.open(key + ".npy") as member:
          while member.read(1 << 24):
            pass
      except (zipfile.BadZipFile, zlib.error, EOFError, OSError) as e:
        raise DataError(
            f"data_dir={path!r}: member {key}.npy is damaged ({first_line(e)}"
            "): its bytes are not the ones the archive recorded; save it "
            "again with np.savez") from None
  integrity.record_checked(path, _CRC_CHECK, identity)


def _open_arrays(data_dir):
  """{key: array} of `data_dir` (an .npz or a folder of .npy files)."""
  if not data_dir:
    raise _contract_error(
        "dataset=numpy needs data_dir (--data_dir): an .npz file with "
        f"{', '.join(KEYS)}, or a folder of those .npy files")
  arrays = {}
  if os.path.isdir(data_dir):
    found = {k for k in KEYS
             if os.path.isfile(os.path.join(data_dir, k + ".npy"))}
    missing = _missing(found)
    if missing:
      raise _contract_error(
          f"data_dir={data_dir!r} has no "
          f"{', '.join(k + '.npy' for k in missing)}; a numpy folder holds "
          f"{', '.join(k + '.npy' for k in KEYS)}")
    for key in KEYS + (CLASS_NAMES_KEY,):
      path = os.path.join(data_dir, key + ".npy")
      if os.path.isfile(path):
        arrays[key] = _load(_npy_file, path, key)
    return arrays
  if not os.path.isfile(data_dir):
    raise DataError(f"data_dir={data_dir!r} does not exist (dataset=numpy "
                    "reads an .npz file or a folder of .npy files)")
  try:
    with zipfile.ZipFile(data_dir) as archive:
      members = {n[:-4] for n in archive.namelist() if n.endswith(".npy")}
  except (zipfile.BadZipFile, OSError) as e:
    raise DataError(f"data_dir={data_dir!r} is not an .npz file ({e})") from None
  missing = _missing(members)
  if missing:
    raise _contract_error(
        f"data_dir={data_dir!r} has no {', '.join(missing)}; it has "
        f"{', '.join(sorted(members)) or 'nothing'}")
  present = [k for k in KEYS + (CLASS_NAMES_KEY,) if k in members]
  compressed = []
  for key in present:
    array = _load(_npz_member, data_dir, key)
    if array is None:
      compressed.append(key)
      array = _load(lambda p, k: np.load(p, allow_pickle=False)[k],
                    data_dir, key)
    arrays[key] = array
  _check_crcs(data_dir, present)
  if compressed:
    logging.warning(
        "%s is compressed: %s read into memory (np.savez, or a folder of "
        ".npy files, is memory-mapped instead)", data_dir,
        ", ".join(compressed))
  return arrays


def _missing(found):
  """The keys of `KEYS` a numpy set with the keys `found` lacks: both
  features, and both labels or none (unlabeled data)."""
  wanted = KEYS if any(k in found for k in LABEL_KEYS) else FEATURE_KEYS
  return [k for k in wanted if k not in found]


def _load(load, path, key):
  try:
    return load(path, key)
  except DataError:
    raise
  except (ValueError, OSError, EOFError, zipfile.BadZipFile) as e:
    raise DataError(f"cannot read {key} from {path}: "
                    f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}"
                    ) from None


def _distinct(labels, chunk=1 << 22):
  """The sorted distinct values of `labels`, read about `chunk` values at a
  time (a mapped array is never copied whole)."""
  seen = np.zeros(0, labels.dtype)
  rows = max(1, chunk // max(1, int(np.prod(labels.shape[1:]))))
  for start in range(0, len(labels), rows):
    seen = np.union1d(seen, labels[start:start + rows])
  return seen


def _classes_of_labels(data_dir, labels):
  """The class count of `labels` ({split: labels}) without class names: the
  largest label + 1 (at least 2), unless that is far beyond the labels'
  distinct values (more than `_SPREAD` times their number + `_SLACK`): then
  a stray label, which would build that many classes, is a DataError."""
  distinct = np.unique(np.concatenate([_distinct(y) for y in labels.values()]))
  top = int(distinct[-1])
  if top + 1 > _SPREAD * len(distinct) + _SLACK:
    split, y = next((k, y) for k, y in labels.items()
                    if len(y) and int(np.max(y)) == top)
    example = np.unravel_index(
        int(np.argmax(np.asarray(y).reshape(-1) == top)), y.shape)[0]
    raise _contract_error(
        f"data_dir={data_dir!r}: y_{split} example {example} has label {top}, "
        f"which would make {top + 1} classes, but the labels hold only "
        f"{len(distinct)} distinct values; fix that label, or give "
        f"{CLASS_NAMES_KEY} (one name per class) to declare the classes")
  return max(top + 1, 2)


class NumpyDataset(inputs.ReadPerInputPipeline, ArraySplits):
  """Memory-mapped train and test arrays, streamed by index.

  Has the attributes of an `ArrayDataset` (`train_x` ... are the mapped
  arrays) and streams itself (`train_dataset`, `distribute_train`,
  `distribute_eval`), so that no pipeline embeds a whole array.
  """

  def __init__(self, data_dir, class_names=None):
    arrays = _open_arrays(data_dir)
    self.name = "numpy"
    self.data_dir = data_dir
    self.train_x, self.train_y = arrays["x_train"], arrays.get("y_train")
    self.test_x, self.test_y = arrays["x_test"], arrays.get("y_test")
    for split, x, y in (("train", self.train_x, self.train_y),
                        ("test", self.test_x, self.test_y)):
      if x.ndim < 2 or len(x) == 0:
        raise _contract_error(
            f"data_dir={data_dir!r}: x_{split} has shape {x.shape}; expected "
            "[examples, features...] with at least one example")
      if not (np.issubdtype(x.dtype, np.number) or x.dtype == np.bool_):
        raise _contract_error(
            f"data_dir={data_dir!r}: x_{split} is {x.dtype}; features are "
            "numbers")
    if self.train_x.shape[1:] != self.test_x.shape[1:]:
      raise DataError(f"data_dir={data_dir!r}: x_train examples have shape "
                      f"{self.train_x.shape[1:]}, x_test's "
                      f"{self.test_x.shape[1:]}")
    if self.train_x.dtype != self.test_x.dtype:
      # uint8 is divided by 255 and other dtypes are not: the model would
      # be scored on inputs of another scale than it learned.
      raise _contract_error(
          f"data_dir={data_dir!r}: x_train is {self.train_x.dtype} but "
          f"x_test is {self.test_x.dtype}; save both with one dtype")
    if self.train_y is None:
      self.class_names = ()
      return
    for split, x, y in (("train", self.train_x, self.train_y),
                        ("test", self.test_x, self.test_y)):
      if len(y) != len(x):
        raise _contract_error(
            f"data_dir={data_dir!r}: x_{split} has {len(x)} examples but "
            f"y_{split} has {len(y)} labels")
      if not (np.issubdtype(y.dtype, np.integer)
              or np.issubdtype(y.dtype, np.floating)):
        raise _contract_error(
            f"data_dir={data_dir!r}: y_{split} is {y.dtype}; labels are "
            "integer class indices (or float targets)")
    if self.train_y.shape[1:] != self.test_y.shape[1:]:
      raise DataError(f"data_dir={data_dir!r}: y_train labels have shape "
                      f"{self.train_y.shape[1:]}, y_test's "
                      f"{self.test_y.shape[1:]}")
    kinds = {np.issubdtype(y.dtype, np.floating)
             for y in (self.train_y, self.test_y)}
    if kinds == {True}:
      # Targets, not classes: kept in their own shape (a [N, 1] column
      # fits a model of one output).
      self.class_names = ()
      return
    if len(kinds) > 1:
      raise _contract_error(
          f"data_dir={data_dir!r}: y_train is {self.train_y.dtype}, y_test "
          f"{self.test_y.dtype}; give both integer class indices or both "
          "float targets")
    for split in ("train", "test"):
      y = getattr(self, f"{split}_y")
      if y.ndim == 2 and y.shape[1] == 1:
        # One class index per example, as a column: a classification label.
        logging.info("%s: y_%s has shape %s: read as class indices of shape "
                     "[%d]", data_dir, split, y.shape, len(y))
        setattr(self, f"{split}_y", y[:, 0])
    if class_names is None and CLASS_NAMES_KEY in arrays:
      class_names = [str(n) for n in np.asarray(arrays[CLASS_NAMES_KEY])]
    if class_names is None:
      classes = _classes_of_labels(data_dir, {"train": self.train_y,
                                              "test": self.test_y})
      class_names = [f"class_{i}" for i in range(classes)]
    self.class_names = tuple(class_names)

  @property
  def has_labels(self):
    """Whether the examples have labels (class indices or targets)."""
    return self.train_y is not None

  @property
  def has_classes(self):
    """Whether the labels are class indices (not float targets, not
    absent)."""
    return bool(self.class_names)

  @property
  def num_classes(self):
    """The classes; for float targets their last dimension (the model's
    outputs per example, 1 for [examples]); 0 for unlabeled data."""
    if self.train_y is None or self.class_names:
      return len(self.class_names)
    return int(self.train_y.shape[-1]) if self.train_y.ndim > 1 else 1

  @property
  def label_shape(self):
    return None if self.train_y is None else tuple(self.train_y.shape[1:])

  def test_samples(self, n):
    if self.test_y is None:
      return np.asarray(self.test_x[:n]), None
    return np.asarray(self.test_x[:n]), np.asarray(self.test_y[:n])

  def _rows(self, x, y):
    """`indices -> (features, labels)` read from the mapped arrays (the
    features alone for unlabeled data)."""
    x_dtype = tf.as_dtype(x.dtype)
    if y is None:
      def read_x(idx):
        return np.asarray(x[np.asarray(idx)])

      def features_only(idx):
        features = tf.numpy_function(read_x, [idx], x_dtype, stateful=False)
        return tf.ensure_shape(features, [idx.shape[0]] + list(x.shape[1:]))

      return features_only
    # Class indices as int32, targets as float32.
    y_np = np.float32 if np.issubdtype(y.dtype, np.floating) else np.int32
    y_dtype = tf.as_dtype(y_np)

    def read(idx):
      idx = np.asarray(idx)
      return np.asarray(x[idx]), np.asarray(y[idx], y_np)

    def rows(idx):
      features, labels = tf.numpy_function(read, [idx], (x_dtype, y_dtype),
                                           stateful=False)
      count = idx.shape[0]
      return (tf.ensure_shape(features, [count] + list(x.shape[1:])),
              tf.ensure_shape(labels, [count] + list(y.shape[1:])))

    return rows

  def _gather(self, seed, augment):
    rows = self._rows(self.train_x, self.train_y)
    unlabeled = self.train_y is None

    def gather(epoch, idx):
      if unlabeled:
        features, labels = rows(idx), tf.zeros(tf.shape(idx), tf.int32)
      else:
        features, labels = rows(idx)
      features = inputs.to_float(features)
      if augment is not None:
        # The seeds of `inputs`: the same augmentation as in memory.
        seeds = tf.stack([tf.fill(tf.shape(idx), epoch * 1000003 + seed),
                          idx], axis=1)
        features, labels = augment(features, labels, seeds)
      return features if unlabeled else (features, labels)

    return gather

  def train_dataset_fn(self, global_batch_size, *,
                       seed=default(InputConfig, "seed"), start_step=0,
                       augment=None):
    """A `distribute_datasets_from_function` argument: each pipeline reads
    only its replicas' rows of every global batch."""
    check_positive("global_batch_size", global_batch_size)

    def dataset_fn(context):
      replicas = context.num_replicas_in_sync
      per_replica = context.get_per_replica_batch_size(global_batch_size)
      per_pipeline = replicas // context.num_input_pipelines
      first = context.input_pipeline_id * per_pipeline
      ds = inputs._index_batches(  # pylint: disable=protected-access
          self.num_train_examples, global_batch_size, seed, start_step)

      def my_rows(epoch, idx):
        rows = tf.reshape(idx, [replicas, per_replica])[first:first +
                                                        per_pipeline]
        return tf.fill([per_pipeline], epoch), rows

      ds = ds.map(my_rows).unbatch()
      ds = ds.map(self._gather(seed, augment),
                  num_parallel_calls=tf.data.AUTOTUNE)
      return ds.prefetch(tf.data.AUTOTUNE).with_options(inputs.element_sharded_options())

    return dataset_fn

  def train_dataset(self, global_batch_size, *,
                    seed=default(InputConfig, "seed"), start_step=0,
                    augment=None):
    """Endless global batches from step `start_step` on (one pipeline)."""
    check_positive("global_batch_size", global_batch_size)
    ds = inputs._index_batches(  # pylint: disable=protected-access
        self.num_train_examples, global_batch_size, seed, start_step)
    ds = ds.map(self._gather(seed, augment),
                num_parallel_calls=tf.data.AUTOTUNE)
    return ds.prefetch(tf.data.AUTOTUNE).with_options(inputs.element_sharded_options())

  def eval_dataset(self, global_batch_size, *, pad=True):
    """One pass over the test split in order, read by slices; padded
    `MaskedBatch`es (`pad=False`: plain batches, the last one partial)."""
    check_positive("global_batch_size", global_batch_size)
    size = self.num_test_examples
    rows = self._rows(self.test_x, self.test_y)
    ds = tf.data.Dataset.range(0, size, global_batch_size).map(
        lambda start: tf.range(start, tf.minimum(start + global_batch_size,
                                                 size)))
    if self.test_y is None:
      ds = ds.map(lambda idx: inputs.to_float(_unknown_rows((rows(idx),))[0]))
    else:
      ds = ds.map(lambda idx: _unknown_rows(rows(idx)))
      ds = ds.map(lambda x, y: (inputs.to_float(x), y))
    if pad:
      ds = inputs.pad_batches(ds, global_batch_size)
    return ds.prefetch(tf.data.AUTOTUNE).with_options(inputs.element_sharded_options())

  def distribute_eval(self, strategy, global_batch_size):
    return strategy.experimental_distribute_dataset(
        self.eval_dataset(global_batch_size))


def _unknown_rows(batch):
  # The last batch is partial: a batch dimension of None, as `.batch()`.
  return tuple(tf.ensure_shape(t, [None] + t.shape[1:].as_list())
               for t in batch)


def load_numpy(data_dir=None, **_):
  """The `numpy` dataset of `data_dir` (see the module docstring)."""
  return NumpyDataset(data_dir)


def _register():
  from framework.data import datasets  # pylint: disable=g-import-not-at-top
  datasets.DATASETS["numpy"] = load_numpy


_register()
