"""What a dataset held as arrays (in memory or memory-mapped) tells about
itself: the interface `framework.data.file_input`'s datasets share.
"""

import dataclasses
import importlib
import numpy as np
import os
import pickle
from framework.data.config import DatasetOptions, InputConfig
from framework.errors import ConfigError, DataError, check_positive, first_line
from framework.settings import default


class ArraySplits:
  """Shapes and sizes read from `train_x`, `train_y`, `test_x`, `test_y`
  and `class_names` attributes."""

  @property
  def input_shape(self):
    return tuple(self.train_x.shape[1:])

  @property
  def label_shape(self):
    return tuple(self.train_y.shape[1:])

  @property
  def feature_dtype(self):
    """The features' dtype name as stored (`uint8` images are divided by
    255 on their way to the model)."""
    return np.dtype(self.train_x.dtype).name

  @property
  def num_classes(self):
    return len(self.class_names)

  @property
  def num_train_examples(self):
    return len(self.train_x)

  @property
  def num_test_examples(self):
    return len(self.test_x)

  def test_samples(self, n):
    return self.test_x[:n], self.test_y[:n]


CIFAR10_FILES = tuple(f"data_batch_{i}" for i in range(1, 6)) + (
    "test_batch", "batches.meta")
CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog",
                   "frog", "horse", "ship", "truck")
KERAS_CACHE = os.path.join("~", ".keras", "datasets", "cifar-10-batches-py")


@dataclasses.dataclass(frozen=True)
class ArrayDataset(ArraySplits):
  """Train and test splits held in memory.

  Images are uint8 [N, H, W, C] (or float32 features); labels int32 [N, ...].
  """
  name: str
  train_x: np.ndarray
  train_y: np.ndarray
  test_x: np.ndarray
  test_y: np.ndarray
  class_names: tuple


def check_labels(dataset, where=""):
  """Raises DataError unless every label is a class index of `dataset`.

  Checked when the data loads, so that a bad label stops the run before it
  writes anything (not as a NaN or an op error in the middle of training).
  """
  if not getattr(dataset, "has_classes", True):
    return dataset  # unlabeled, or float targets: no class indices
  for split, labels in (("train", dataset.train_y), ("test", dataset.test_y)):
    labels = np.asarray(labels)
    bad = np.flatnonzero((labels < 0) | (labels >= dataset.num_classes))
    if bad.size:
      value = labels.reshape(-1)[bad[0]]
      example = np.unravel_index(bad[0], labels.shape)[0]
      raise DataError(
          f"dataset={dataset.name}{where}: {split} example {example} has "
          f"label {value}, outside the {dataset.num_classes} classes "
          f"(0..{dataset.num_classes - 1}); {bad.size} bad label value(s) in "
          f"the {split} split")
  return dataset


# CIFAR-10's python files are pickles, and a run folder names the one it
# read (model_info.json's data_dir): unpickling an arbitrary class would run
# whatever its `__reduce__` names. The files hold only dicts, lists, bytes,
# strings, ints and numpy arrays, so only the globals those need are found.
def _latin1_encode(text, encoding):
  """`_codecs.encode` as pickle protocol 2 uses it for bytes; nothing else."""
  if not isinstance(text, str) or encoding != "latin1":
    raise pickle.UnpicklingError(
        f"_codecs.encode({type(text).__name__}, {encoding!r})")
  return text.encode("latin1")


_ALLOWED_GLOBALS = {
    # numpy arrays: pickle protocols 0-4 (numpy 1 and 2 names), and 5.
    ("numpy.core.multiarray", "_reconstruct"): None,
    ("numpy._core.multiarray", "_reconstruct"): None,
    ("numpy.core.numeric", "_frombuffer"): None,
    ("numpy._core.numeric", "_frombuffer"): None,
    ("numpy", "ndarray"): None,
    ("numpy", "dtype"): None,
    # bytes written by Python 3 with protocol 2 (write_cifar10's).
    ("_codecs", "encode"): _latin1_encode,
    ("__builtin__", "bytes"): None,
    ("builtins", "bytes"): None,
}


class _PlainDataUnpickler(pickle.Unpickler):
  """An unpickler that refuses every class or function but the few that
  plain data and numpy arrays need."""

  def find_class(self, module, name):
    if (module, name) not in _ALLOWED_GLOBALS:
      raise pickle.UnpicklingError(
          f"it holds a {module}.{name} object, not plain data (a CIFAR-10 "
          "file holds only dicts, lists, bytes, strings, ints and numpy "
          "arrays; other objects could run code when loaded, so none is)")
    return (_ALLOWED_GLOBALS[(module, name)] or
            super().find_class(module, name))


def _unpickle(path):
  """The dict a CIFAR-10 python file holds (bytes keys decoded), read
  without running any code it may name (DataError naming `path`)."""
  try:
    with open(path, "rb") as f:
      raw = _PlainDataUnpickler(f, encoding="bytes").load()
  except Exception as e:  # pickle raises many types on a corrupt file
    raise DataError(f"cannot read CIFAR-10 file {path}: {first_line(e)}"
                    ) from None
  if not isinstance(raw, dict):
    raise DataError(f"CIFAR-10 file {path} holds a {type(raw).__name__}, "
                    "not the dict of a CIFAR-10 batch")
  return {(k.decode() if isinstance(k, bytes) else k): v
          for k, v in raw.items()}


def _cifar_batch(path):
  batch = _unpickle(path)
  if "data" not in batch or "labels" not in batch:
    raise DataError(f"CIFAR-10 file {path} has no 'data'/'labels' entries")
  data = np.asarray(batch["data"], dtype=np.uint8)
  labels = np.asarray(batch["labels"], dtype=np.int32)
  if data.ndim != 2 or data.shape[1] != 3072 or len(labels) != len(data):
    raise DataError(f"CIFAR-10 file {path}: 'data' has shape {data.shape}, "
                    f"expected (N, 3072) with N={len(labels)} labels")
  images = data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
  return np.ascontiguousarray(images), labels


def load_cifar10(data_dir=None):
  """Reads the official CIFAR-10 python-pickle layout from `data_dir`.

  Without `data_dir`, uses Keras's cache, downloading it when online.
  """
  if data_dir is None:
    data_dir = os.path.expanduser(KERAS_CACHE)
    if not os.path.isdir(data_dir):
      import keras  # pylint: disable=g-import-not-at-top
      try:
        keras.datasets.cifar10.load_data()
      except Exception as e:  # offline, proxy, disk: many types
        raise DataError(
            f"no data_dir given and Keras's CIFAR-10 cache {data_dir} is "
            f"missing; downloading it failed ({first_line(e)}): set data_dir "
            "(--data_dir) to a cifar-10-batches-py directory") from None
  missing = [f for f in CIFAR10_FILES
             if not os.path.isfile(os.path.join(data_dir, f))]
  if missing:
    raise DataError(
        f"data_dir={data_dir!r} is not a CIFAR-10 python directory: missing "
        f"{', '.join(missing)} (expected {', '.join(CIFAR10_FILES)})")
  parts = [_cifar_batch(os.path.join(data_dir, f"data_batch_{i}"))
           for i in range(1, 6)]
  test_x, test_y = _cifar_batch(os.path.join(data_dir, "test_batch"))
  meta = _unpickle(os.path.join(data_dir, "batches.meta"))
  names = tuple(n.decode() if isinstance(n, bytes) else n
                for n in meta.get("label_names", CIFAR10_CLASSES))
  return ArrayDataset("cifar10", np.concatenate([p[0] for p in parts]),
                      np.concatenate([p[1] for p in parts]), test_x, test_y,
                      names)


def write_cifar10(data_dir, train_x, train_y, test_x, test_y):
  """Writes arrays in the official CIFAR-10 layout (for tests and tools)."""
  os.makedirs(data_dir, exist_ok=True)

  def dump(name, x, y):
    data = np.asarray(x, np.uint8).transpose(0, 3, 1, 2).reshape(len(x), -1)
    with open(os.path.join(data_dir, name), "wb") as f:
      pickle.dump({b"batch_label": name.encode(), b"data": data,
                   b"labels": [int(v) for v in y],
                   b"filenames": [b"%d.png" % i for i in range(len(x))]},
                  f, protocol=2)

  for i, (x, y) in enumerate(zip(np.array_split(train_x, 5),
                                 np.array_split(train_y, 5)), 1):
    dump(f"data_batch_{i}", x, y)
  dump("test_batch", test_x, test_y)
  with open(os.path.join(data_dir, "batches.meta"), "wb") as f:
    pickle.dump({b"label_names": [n.encode() for n in CIFAR10_CLASSES],
                 b"num_vis": 3072}, f, protocol=2)


def synthetic(num_train=2048, num_test=512, image_shape=(32, 32, 3),
              num_classes=10, seed=default(InputConfig, "seed")):
  """Learnable random images: a class prototype plus noise, as uint8."""
  check_positive("num_train", num_train)
  check_positive("num_test", num_test)
  rng = np.random.default_rng(seed)
  prototypes = rng.uniform(40, 215, size=(num_classes,) + tuple(image_shape))

  def make(n):
    labels = rng.integers(0, num_classes, size=n).astype(np.int32)
    noise = rng.normal(0, 40, size=(n,) + tuple(image_shape))
    images = np.clip(prototypes[labels] + noise, 0, 255).astype(np.uint8)
    return images, labels

  train_x, train_y = make(num_train)
  test_x, test_y = make(num_test)
  return ArrayDataset("synthetic", train_x, train_y, test_x, test_y,
                      tuple(f"class_{i}" for i in range(num_classes)))


DATASETS = {"cifar10": lambda data_dir=None, **_: load_cifar10(data_dir),
            "synthetic": lambda data_dir=None, seed=default(
                InputConfig, "seed"), **_: synthetic(seed=seed)}


# Modules that add their datasets to DATASETS when imported.
_REGISTERING_MODULES = ("framework.data.segmentation_data", "framework.data.file_input",
                        "framework.data.text",
                        "framework.data.image_folder",
                        "framework.data.tfds_input",
                        "framework.data.numpy_input",
                        "framework.data.mixture")
# Loaders named by a prefix: `load_dataset("tfds:mnist")` calls
# DATASETS["tfds"](spec="mnist", ...).
_SPEC_LOADERS = ("tfds",)


def load_dataset(name, data_dir=None, seed=default(InputConfig, "seed"),
                 **options):
  """Loads a dataset by name (see DATASETS); `options` (e.g. image_size) go
  to the loaders that take them."""
  for module in _REGISTERING_MODULES:
    importlib.import_module(module)
  # `tfds:NAME[:VERSION]`: the loader registered as `tfds` gets the rest.
  key, _, spec = name.partition(":")
  if key not in _SPEC_LOADERS:
    key = name
  if key not in DATASETS:
    known = sorted(set(DATASETS) - set(_SPEC_LOADERS))
    raise ConfigError(f"dataset={name!r} is unknown; known datasets: "
                      f"{', '.join(known)}, tfds:NAME[:VERSION]")
  if key in _SPEC_LOADERS:
    options["spec"] = spec
  dataset = DATASETS[key](data_dir=data_dir, seed=seed, **options)
  shuffle = default(DatasetOptions, "file_shuffle")
  if (options.get("file_shuffle", shuffle) != shuffle and
      hasattr(dataset, "train_y")):
    raise ConfigError(f"file_shuffle={options['file_shuffle']} is for "
                      "datasets streamed from files (tfrecord, image_folder, "
                      f"tfds:NAME), not dataset={name}")
  if not hasattr(dataset, "train_y"):
    return dataset  # Streamed from files: labels are checked by the reader.
  return check_labels(dataset, f" (data_dir={data_dir!r})" if data_dir else "")
