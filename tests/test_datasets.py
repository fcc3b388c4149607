"""The CIFAR-10 python-pickle reader, on small data in the real format."""

import os

import numpy as np
import pytest

import framework
import framework.data.datasets  # noqa: F401  (the attribute chain below)
from framework.data import datasets


def tiny_cifar(path, num_train=50, num_test=20):
  rng = np.random.default_rng(0)
  train_x = rng.integers(0, 256, (num_train, 32, 32, 3), dtype=np.uint8)
  test_x = rng.integers(0, 256, (num_test, 32, 32, 3), dtype=np.uint8)
  train_y = rng.integers(0, 10, num_train)
  test_y = rng.integers(0, 10, num_test)
  framework.data.datasets.write_cifar10(str(path), train_x, train_y, test_x, test_y)
  return train_x, train_y, test_x, test_y


def test_reads_the_official_layout(tmp_path):
  train_x, train_y, test_x, test_y = tiny_cifar(tmp_path)
  data = framework.data.datasets.load_cifar10(str(tmp_path))
  np.testing.assert_array_equal(data.train_x, train_x)
  np.testing.assert_array_equal(data.train_y, train_y)
  np.testing.assert_array_equal(data.test_x, test_x)
  np.testing.assert_array_equal(data.test_y, test_y)
  assert data.class_names[0] == "airplane" and data.num_classes == 10
  assert data.input_shape == (32, 32, 3)


def test_channel_order_is_the_official_one(tmp_path):
  # Rows are 1024 red, 1024 green, 1024 blue values.
  tiny_cifar(tmp_path)
  raw = datasets._unpickle(os.path.join(tmp_path, "test_batch"))  # pylint: disable=protected-access
  data = framework.data.datasets.load_cifar10(str(tmp_path))
  assert data.test_x[0, 0, 1, 0] == raw["data"][0][1]
  assert data.test_x[0, 0, 0, 2] == raw["data"][0][2048]


def test_missing_files_are_named(tmp_path):
  tiny_cifar(tmp_path)
  os.remove(tmp_path / "data_batch_3")
  with pytest.raises(framework.DataError, match="missing data_batch_3"):
    framework.data.datasets.load_cifar10(str(tmp_path))
  with pytest.raises(framework.DataError, match="nowhere"):
    framework.data.datasets.load_cifar10(str(tmp_path / "nowhere"))


def test_malformed_file_is_named(tmp_path):
  tiny_cifar(tmp_path)
  (tmp_path / "data_batch_2").write_bytes(b"not a pickle")
  with pytest.raises(framework.DataError, match="data_batch_2"):
    framework.data.datasets.load_cifar10(str(tmp_path))


def test_synthetic_is_learnable_and_seeded():
  a = framework.data.datasets.synthetic(num_train=64, num_test=16, seed=3)
  b = framework.data.datasets.synthetic(num_train=64, num_test=16, seed=3)
  np.testing.assert_array_equal(a.train_x, b.train_x)
  assert not np.array_equal(a.train_x, framework.data.datasets.synthetic(
      num_train=64, num_test=16, seed=4).train_x)
  # Nearest class mean (from the train split) classifies the test split.
  flat = lambda x: x.reshape(len(x), -1).astype(np.float32)
  means = np.stack([flat(a.train_x)[a.train_y == c].mean(0)
                    if (a.train_y == c).any() else np.full(32 * 32 * 3, 1e9)
                    for c in range(10)])
  distances = ((flat(a.test_x)[:, None] - means[None]) ** 2).sum(-1)
  assert (distances.argmin(1) == a.test_y).mean() > 0.8


def test_unknown_dataset():
  with pytest.raises(framework.ConfigError, match="dataset='mnist'"):
    framework.data.datasets.load_dataset("mnist")
