"""`--dataset=numpy`: memory-mapped arrays of any shape, exact batches."""

import numpy as np
import pytest

from framework.data import datasets, inputs, numpy_input
from framework.errors import DataError


def _arrays(n=100, features=16):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(n, features)).astype(np.float32)
  y = (x[:, 0] > 0).astype(np.int32)
  return dict(x_train=x, y_train=y, x_test=x[:37], y_test=y[:37])


@pytest.mark.parametrize("layout", ["npz", "folder"])
def test_mapped_batches_equal_the_in_memory_ones_from_any_step(tmp_path,
                                                                layout):
  arrays = _arrays()
  if layout == "npz":
    path = str(tmp_path / "d.npz")
    np.savez(path, **arrays)
  else:
    path = str(tmp_path / "d")
    (tmp_path / "d").mkdir()
    for key, value in arrays.items():
      np.save(tmp_path / "d" / f"{key}.npy", value)
  mapped = datasets.load_dataset("numpy", path)
  assert isinstance(mapped.train_x, np.memmap)
  assert mapped.input_shape == (16,)
  assert mapped.class_names == ("class_0", "class_1")
  memory = datasets.ArrayDataset("a", arrays["x_train"], arrays["y_train"],
                                 arrays["x_test"], arrays["y_test"],
                                 mapped.class_names)
  for start in (0, 5, 17):  # 17: into the second epoch (12 steps each)
    got = list(inputs.train_dataset(mapped, 8, seed=3,
                                    start_step=start).take(3))
    want = list(inputs.train_dataset(memory, 8, seed=3,
                                     start_step=start).take(3))
    for (gx, gy), (wx, wy) in zip(got, want):
      np.testing.assert_array_equal(gx, wx)
      np.testing.assert_array_equal(gy, wy)


def test_eval_reads_every_test_example_once_padded(tmp_path):
  path = str(tmp_path / "d.npz")
  np.savez(path, **_arrays())
  batches = list(datasets.load_dataset("numpy", path).eval_dataset(16))
  assert [b.batch[0].shape[0] for b in batches] == [16, 16, 16]
  assert sum(float(b.mask.numpy().sum()) for b in batches) == 37
  got = np.concatenate([b.batch[0].numpy()[b.mask.numpy() > 0]
                        for b in batches])
  np.testing.assert_array_equal(got, _arrays()["x_test"])


def test_compressed_npz_is_read_into_memory(tmp_path):
  path = str(tmp_path / "c.npz")
  np.savez_compressed(path, **_arrays())
  dataset = datasets.load_dataset("numpy", path)
  assert not isinstance(dataset.train_x, np.memmap)
  assert dataset.num_train_examples == 100


def test_bad_files_are_one_data_error_naming_them(tmp_path):
  arrays = _arrays()
  del arrays["y_test"]
  path = str(tmp_path / "d.npz")
  np.savez(path, **arrays)
  with pytest.raises(DataError, match="has no y_test"):
    numpy_input.load_numpy(path)
  with pytest.raises(DataError, match="needs data_dir"):
    numpy_input.load_numpy(None)
  arrays = _arrays()
  arrays["y_train"] = arrays["y_train"][:50]
  np.savez(path, **arrays)
  with pytest.raises(DataError, match="100 examples but y_train has 50"):
    numpy_input.load_numpy(path)
