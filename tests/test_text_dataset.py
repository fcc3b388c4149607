"""--dataset=text: byte windows with next-byte targets, split by file,
sharded by file across input pipelines, resumed exactly at any step."""

import os

import numpy as np
import pytest
import tensorflow as tf

import framework
from framework.data import datasets, text

LENGTH = 16


def write_corpus(folder, num_files=12, seed=0):
  """Files of 40..200 random printable bytes; returns {path: bytes}."""
  rng = np.random.default_rng(seed)
  os.makedirs(folder, exist_ok=True)
  contents = {}
  for i in range(num_files):
    data = bytes(rng.integers(32, 127, size=int(rng.integers(40, 200)))
                 .astype(np.uint8))
    path = os.path.join(folder, f"doc_{i:02d}.txt")
    with open(path, "wb") as f:
      f.write(data)
    contents[path] = data
  return contents


def batches(ds, n):
  return [tuple(np.asarray(t) for t in b) for b in ds.take(n)]


def test_windows_are_the_files_bytes_and_targets_the_next_ones(tmp_path):
  contents = write_corpus(tmp_path / "corpus")
  dataset = datasets.load_dataset("text", str(tmp_path / "corpus"),
                                  sequence_length=LENGTH)
  assert dataset.input_shape == (LENGTH,) and dataset.num_classes == 256
  assert text.is_text(dataset)
  splits = text.scan(str(tmp_path / "corpus"))
  assert not set(splits["train"]) & set(splits["test"])
  assert sorted(splits["train"] + splits["test"]) == sorted(contents)
  expected = {}
  for path in splits["train"]:
    data = contents[path]
    for w in range((len(data) - 1) // LENGTH):
      expected[data[w * LENGTH:(w + 1) * LENGTH + 1]] = True
  assert dataset.num_train_examples == len(expected)
  seen = []
  for tokens, targets in batches(dataset.train_dataset(1), len(expected)):
    assert tokens.dtype == np.int32 and tokens.shape == (1, LENGTH)
    np.testing.assert_array_equal(tokens[0, 1:], targets[0, :-1])
    seen.append(bytes(np.concatenate([tokens[0], targets[0, -1:]])
                      .astype(np.uint8)))
  # One epoch: every window exactly once.
  assert sorted(seen) == sorted(expected)


def test_two_pipelines_read_disjoint_files_and_all_of_them(tmp_path):
  write_corpus(tmp_path / "corpus", num_files=30)
  dataset = text.load_text(str(tmp_path / "corpus"), LENGTH,
                           files_per_shard=2)
  shards = len(dataset.train.counts)
  assert shards >= 4
  ctx = lambda i: tf.distribute.InputContext(
      num_input_pipelines=2, input_pipeline_id=i, num_replicas_in_sync=2)
  fn = dataset.train_dataset_fn(8)
  steps = [min(sum(dataset.train.counts[j]
                   for j in range(i, shards, 2)) // 4, 50) for i in (0, 1)]
  windows = []
  for i in (0, 1):
    rows = [tuple(r) for t, _ in batches(fn(ctx(i)), steps[i]) for r in t]
    windows.append(set(rows))
  assert windows[0] and windows[1] and not windows[0] & windows[1]


def test_resume_at_any_step_gives_the_same_batches(tmp_path):
  write_corpus(tmp_path / "corpus", num_files=20)
  dataset = text.load_text(str(tmp_path / "corpus"), LENGTH,
                           files_per_shard=3)
  per_epoch = dataset.num_train_examples // 4
  straight = batches(dataset.train_dataset(4, seed=3), 2 * per_epoch + 3)
  for start in (1, per_epoch - 1, per_epoch + 2):
    resumed = batches(dataset.train_dataset(4, seed=3, start_step=start), 3)
    for a, b in zip(straight[start:start + 3], resumed):
      np.testing.assert_array_equal(a[0], b[0])
      np.testing.assert_array_equal(a[1], b[1])
  # Another epoch is another order.
  assert not np.array_equal(straight[0][0], straight[per_epoch][0])


def test_the_builtin_corpus_is_the_standard_library(tmp_path):
  splits = text.scan(None)
  folder = os.path.dirname(os.__file__)
  assert all(os.path.dirname(p) == folder and p.endswith(".py")
             for p in splits["train"] + splits["test"])
  assert os.path.join(folder, "os.py") in splits["train"] + splits["test"]
  files = len(splits["train"]) + len(splits["test"])
  assert len(splits["test"]) == len(range(text.TEST_EVERY // 2, files,
                                          text.TEST_EVERY))
  assert text.scan(None) == splits  # fixed: the same split every time


def test_a_file_that_changed_is_one_line_naming_it(tmp_path):
  contents = write_corpus(tmp_path / "corpus")
  dataset = text.load_text(str(tmp_path / "corpus"), LENGTH)
  path = text.scan(str(tmp_path / "corpus"))["train"][0]
  with open(path, "ab") as f:
    f.write(b"more text")
  with pytest.raises(tf.errors.InvalidArgumentError) as e:
    batches(dataset.train_dataset(dataset.num_train_examples), 1)
  error = framework.data.integrity.data_error(e.value)
  assert error is not None and path in str(error) and (
      f"{len(contents[path]) + 9} bytes" in str(error))


@pytest.mark.parametrize("make,fragment", [
    (lambda d: None, "is not a directory"),
    (lambda d: os.makedirs(d), "has 0 file(s)"),
    (lambda d: write_corpus(d, num_files=3) and [
        open(p, "wb").write(b"x") for p in text.scan(d)["test"]],
     "no test file is longer than sequence_length=16"),
])
def test_unusable_folders_are_one_data_error(tmp_path, make, fragment):
  folder = str(tmp_path / "corpus")
  make(folder)
  with pytest.raises(framework.DataError) as e:
    text.load_text(folder, LENGTH)
  assert fragment in str(e.value)


def test_unigram_entropy_of_uniform_and_constant_bytes(tmp_path):
  folder = tmp_path / "corpus"
  os.makedirs(folder)
  (folder / "a").write_bytes(bytes(range(256)) * 4)
  (folder / "b").write_bytes(b"x" * 100)
  assert text.unigram_entropy([str(folder / "a")]) == pytest.approx(
      np.log(256))
  assert text.unigram_entropy([str(folder / "b")]) == 0.0
