"""Byte-level text for language modelling, streamed from a folder of files.

    --dataset=text --data_dir=corpus/           every file under it (sorted);
                                                or corpus/train/, corpus/test/
    --dataset=text                              the built-in corpus: this
                                                Python's standard library
                                                sources (*.py beside os.py)

Tokens are bytes (a vocabulary of 256). Each file is cut into
non-overlapping windows of `sequence_length + 1` bytes that overlap by one:
an example is `tokens = window[:-1]`, `targets = window[1:]` (the next
byte at every position); a file's tail shorter than a window is dropped,
windows never cross files. Without train/ and test/ sub-folders, every
`TEST_EVERY`-th file in sorted order is the test split (split by file, so
no test text is trained on).

The splits are `framework.data.file_input.FileDataset`s whose shards are
fixed groups of files (dealt in a seeded order): streamed per input
pipeline, sharded by file across workers, resumed exactly at any step. A
file whose size changed since the run loaded it fails the pipeline with
one line naming it.
"""

import hashlib
import os

import numpy as np
import tensorflow as tf

from framework.data import file_input, integrity
from framework.data.config import DatasetOptions
from framework.errors import DataError, check_positive
from framework.settings import default

DEFAULT_SEQUENCE_LENGTH = default(DatasetOptions, "sequence_length")
TEST_EVERY = 10
FILES_PER_SHARD = 4
VOCAB_SIZE = 256
TASK = "language_model"


def builtin_corpus_dir():
  """The built-in corpus: the standard library folder of this Python."""
  return os.path.dirname(os.__file__)


def _builtin_files():
  folder = builtin_corpus_dir()
  return [os.path.join(folder, f) for f in sorted(os.listdir(folder))
          if f.endswith(".py") and os.path.isfile(os.path.join(folder, f))]


def _folder_files(folder):
  """Every regular file under `folder` (hidden ones left out), sorted by
  relative path."""
  found = []
  for root, dirs, files in os.walk(folder):
    dirs[:] = sorted(d for d in dirs if not d.startswith("."))
    found += [os.path.join(root, f) for f in files if not f.startswith(".")]
  return sorted((f for f in found if os.path.isfile(f)),
                key=lambda f: os.path.relpath(f, folder))


def scan(data_dir=None):
  """{"train": [paths], "test": [paths]} of a folder (or the built-in
  corpus when `data_dir` is None)."""
  if data_dir is None:
    files = _builtin_files()
    where = f"the built-in corpus ({builtin_corpus_dir()})"
  else:
    if not os.path.isdir(data_dir):
      raise DataError(f"data_dir={data_dir!r} is not a directory (expected a "
                      "folder of text files, or train/ and test/ holding "
                      "them)")
    train_dir, test_dir = (os.path.join(data_dir, s) for s in ("train",
                                                               "test"))
    if os.path.isdir(train_dir) and os.path.isdir(test_dir):
      splits = {"train": _folder_files(train_dir),
                "test": _folder_files(test_dir)}
      for name, paths in splits.items():
        if not paths:
          raise DataError(f"{os.path.join(data_dir, name)} has no files")
      return splits
    files = _folder_files(data_dir)
    where = f"data_dir={data_dir!r}"
  if len(files) < 2:
    raise DataError(f"{where} has {len(files)} file(s): at least 2 are "
                    "needed to split off a test file")
  test = [f for i, f in enumerate(files) if i % TEST_EVERY == TEST_EVERY // 2]
  if not test:  # fewer files than TEST_EVERY // 2 + 1: the last one
    test = files[-1:]
  test_set = set(test)
  return {"train": [f for f in files if f not in test_set], "test": test}


def _windows(size, sequence_length):
  """Windows of `sequence_length + 1` bytes, stride `sequence_length`."""
  return max(size - 1, 0) // sequence_length


def _split(paths, sequence_length, files_per_shard, name, split):
  """A `ShardedSplit` of `paths`: records {index, tokens [L + 1]}."""
  sizes = [os.path.getsize(p) for p in paths]
  kept = [(p, s) for p, s in zip(paths, sizes)
          if _windows(s, sequence_length) > 0]
  if not kept:
    raise DataError(f"dataset={name}: no {split} file is longer than "
                    f"sequence_length={sequence_length} bytes; use a smaller "
                    "--sequence_length or longer files")
  # Example indices in sorted file order; shards deal the files in a
  # seeded order so that each holds a mix of the corpus.
  windows = [_windows(s, sequence_length) for _, s in kept]
  first_index = np.concatenate([[0], np.cumsum(windows)[:-1]])
  order = np.random.default_rng(0).permutation(len(kept))
  groups = [g for g in np.array_split(
      order, -(-len(kept) // files_per_shard)) if len(g)]
  flat = np.concatenate(groups)
  counts = tuple(int(sum(windows[i] for i in g)) for g in groups)
  paths_t = tf.constant([kept[i][0] for i in flat])
  sizes_t = tf.constant([kept[i][1] for i in flat], tf.int64)
  windows_t = tf.constant([windows[i] for i in flat], tf.int64)
  first_t = tf.constant([first_index[i] for i in flat], tf.int64)
  starts = tf.constant(np.cumsum([0] + [len(g) for g in groups[:-1]]),
                       tf.int64)
  lengths = tf.constant([len(g) for g in groups], tf.int64)
  window = sequence_length + 1

  def file_records(f):
    contents = tf.io.read_file(paths_t[f])
    size = tf.cast(tf.strings.length(contents), tf.int64)
    ok = integrity.check(
        tf.equal(size, sizes_t[f]), "text file ", paths_t[f], " has ",
        lambda: tf.strings.as_string(size), " bytes, not the ",
        lambda: tf.strings.as_string(sizes_t[f]), " it had when the run "
        "started (changed while training?); restore it or start a new run")
    with tf.control_dependencies([ok]):
      data = tf.cast(tf.io.decode_raw(contents, tf.uint8), tf.int32)
    n = windows_t[f]
    frames = tf.signal.frame(data[:n * sequence_length + 1], window,
                             sequence_length)
    return tf.data.Dataset.from_tensor_slices({
        "index": first_t[f] + tf.range(n, dtype=tf.int64),
        "tokens": tf.ensure_shape(frames, [None, window])})

  def read(ids):
    return tf.data.Dataset.from_tensor_slices(ids).flat_map(
        lambda s: tf.data.Dataset.range(starts[s], starts[s] + lengths[s])
    ).flat_map(file_records)

  def decode(record):
    tokens = record["tokens"]
    return record["index"], tokens[:-1], tokens[1:]

  return file_input.ShardedSplit(counts, read, decode,
                                lambda records: records["index"])


def unigram_entropy(paths):
  """The entropy (nats/byte) of the byte frequencies of `paths`: the loss
  of a model that ignores context; exp of it is the unigram perplexity
  that a language model must beat."""
  counts = np.zeros(VOCAB_SIZE, np.int64)
  for path in paths:
    with open(path, "rb") as f:
      counts += np.bincount(np.frombuffer(f.read(), np.uint8),
                            minlength=VOCAB_SIZE)
  p = counts[counts > 0] / counts.sum()
  return float(-(p * np.log(p)).sum())


def _byte_name(value):
  char = chr(value)
  return char if char.isprintable() and value < 128 else f"\\x{value:02x}"


def _generation(splits):
  """A digest of the files (relative names and sizes): resuming on other
  files is a config change."""
  digest = hashlib.sha256()
  for split in ("train", "test"):
    paths = splits[split]
    root = os.path.commonpath(paths) if len(paths) > 1 else os.path.dirname(
        paths[0])
    for path in paths:
      digest.update(f"{split}:{os.path.relpath(path, root)}:"
                    f"{os.path.getsize(path)}\n".encode())
  return digest.hexdigest()[:16]


class TextDataset(file_input.FileDataset):
  """A `FileDataset` of token sequences: features stay int32 tokens."""
  task = TASK
  feature_dtype = "int32"

  def prepare_features(self, features):
    return tf.cast(features, tf.int32)


def load_text(data_dir=None, sequence_length=DEFAULT_SEQUENCE_LENGTH,
              files_per_shard=FILES_PER_SHARD,
              shuffle=default(DatasetOptions, "file_shuffle")):
  """The `FileDataset` of byte sequences of `data_dir` (None: the built-in
  corpus); `tokens` int32 [sequence_length], targets the next bytes."""
  check_positive("sequence_length", sequence_length)
  check_positive("files_per_shard", files_per_shard)
  splits = scan(data_dir)
  name = "text"
  train = _split(splits["train"], sequence_length, files_per_shard, name,
                 "train")
  test = _split(splits["test"], sequence_length, files_per_shard, name,
                "test")
  return TextDataset(
      name, train, test,
      class_names=[_byte_name(i) for i in range(VOCAB_SIZE)],
      image_shape=(sequence_length,), label_shape=(sequence_length,),
      shuffle=shuffle, generation=_generation(splits))


def is_text(dataset):
  """Whether `dataset` is a language-model dataset (token sequences)."""
  return getattr(dataset, "task", None) == TASK


def _register():
  from framework.data import datasets  # pylint: disable=g-import-not-at-top

  def load(data_dir=None, sequence_length=DEFAULT_SEQUENCE_LENGTH,
           file_shuffle=default(DatasetOptions, "file_shuffle"), **_):
    return load_text(data_dir, sequence_length, shuffle=file_shuffle)

  datasets.DATASETS["text"] = load


_register()
