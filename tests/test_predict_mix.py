"""predict.py --index on a --dataset=mix run: the mixture's test split is
its sources' test splits one after another, as evaluation reads it."""

import numpy as np

from framework.app import prediction


def _write(path, offset, num_test):
  rng = np.random.default_rng(offset)
  np.savez(path, x_train=rng.random((8, 3), np.float32),
           y_train=np.arange(8) % 2,
           x_test=offset + np.arange(num_test * 3, dtype=np.float32)
           .reshape(num_test, 3), y_test=np.arange(num_test) % 2)


def test_index_counts_through_the_sources_in_order(tmp_path):
  _write(tmp_path / "a.npz", 0, 3)
  _write(tmp_path / "b.npz", 100, 4)
  info = {"dataset": "mix", "seed": 1, "dataset_options": {
      "mix": ["a=numpy:0.5", "b=numpy:0.5"],
      "mix_data_dirs": [f"a:{tmp_path / 'a.npz'}", f"b:{tmp_path / 'b.npz'}"]}}
  image, label, _ = prediction.test_example(info, 1)
  np.testing.assert_array_equal(image, [3, 4, 5])
  assert label == 1
  image, label, _ = prediction.test_example(info, 5)  # b's test #2
  np.testing.assert_array_equal(image, [106, 107, 108])
  assert label == 0
