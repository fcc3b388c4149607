"""`--dataset=numpy` refuses damaged files before anything is mapped or
written: stored bytes that are not what an array's header needs, an `.npz`
member that fails its CRC-32 (checked once per file as it is, recorded in
distloop's cache folder, never the data folder)."""

import os
import zipfile

import numpy as np
import pytest

from framework.data import numpy_input
from framework.errors import DataError
from helpers import assert_one_line_error, run_script, snapshot

TRAIN = ("train.py", "--model=mlp", "--dataset=numpy", "--train_steps=2",
         "--global_batch_size=16", "--noexport_saved_model")


def _arrays():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(64, 8)).astype(np.float32)
  y = (x[:, 0] > 0).astype(np.int32)
  return dict(x_train=x, y_train=y, x_test=x[:16], y_test=y[:16])


def _write_npz(path):
  np.savez(path, **_arrays())
  return str(path)


def _flip_byte(path):
  """Flips a byte in the middle of x_train's data, keeping the file size."""
  with open(path, "rb") as f:
    data = f.read()
  at = data.index(_arrays()["x_train"].tobytes()) + 1000
  with open(path, "r+b") as f:
    f.seek(at)
    f.write(bytes([data[at] ^ 0xFF]))


def test_a_member_with_a_bad_crc_is_one_line_naming_it(tmp_path):
  path = _write_npz(tmp_path / "data.npz")
  _flip_byte(path)
  with pytest.raises(zipfile.BadZipFile, match="Bad CRC-32"):
    np.load(path)["x_train"]  # what numpy itself says
  before = snapshot(tmp_path / "run")
  proc = run_script(*TRAIN, f"--data_dir={path}", "--model_dir=run",
                    cwd=tmp_path, check=False)
  assert_one_line_error(proc, "train.py", path, "x_train.npy", "CRC-32",
                        unchanged=before)
  assert not (tmp_path / "run").exists()


def test_headers_listing_more_rows_than_stored_are_one_line(tmp_path):
  path = _write_npz(tmp_path / "data.npz")
  with open(path, "rb") as f:
    data = f.read()
  # Both headers of the train split claim 99 rows: they would agree, and
  # map the neighbouring bytes (the test split, the zip directory).
  for old, new in ((b"'shape': (64, 8)", b"'shape': (99, 8)"),
                   (b"'shape': (64,)", b"'shape': (99,)")):
    assert data.count(old) == 1
    data = data.replace(old, new)
  with open(path, "wb") as f:
    f.write(data)
  before = snapshot(tmp_path / "run")
  proc = run_script(*TRAIN, f"--data_dir={path}", "--model_dir=run",
                    cwd=tmp_path, check=False)
  assert_one_line_error(proc, "train.py", path, "x_train.npy",
                        "header lists shape (99, 8)", "stores 2048 bytes",
                        unchanged=before)


@pytest.mark.parametrize("change,stored", [(-32, 2016), (32, 2080)])
def test_npy_file_of_another_size_than_its_header_is_refused(
    tmp_path, change, stored):
  folder = tmp_path / "arrays"
  folder.mkdir()
  for key, value in _arrays().items():
    np.save(folder / f"{key}.npy", value)
  path = folder / "x_train.npy"
  size = os.path.getsize(path)
  if change < 0:
    os.truncate(path, size + change)
  else:
    with open(path, "ab") as f:
      f.write(b"\0" * change)
  with pytest.raises(DataError) as e:
    numpy_input.load_numpy(str(folder))
  message = str(e.value)
  assert "\n" not in message
  for fragment in (str(folder), "x_train.npy", "header lists shape (64, 8)",
                   f"stores {stored} bytes"):
    assert fragment in message


def test_the_crc_pass_is_recorded_outside_the_data_folder_once(
    tmp_path, monkeypatch):
  cache = tmp_path / "cache"
  monkeypatch.setenv("DISTLOOP_CACHE_DIR", str(cache))
  data = tmp_path / "data"
  data.mkdir()
  path = _write_npz(data / "data.npz")
  folder = snapshot(data)
  assert numpy_input.load_numpy(path).num_train_examples == 64
  assert snapshot(data) == folder  # nothing written beside the data
  records = list(cache.rglob("*.json"))
  assert len(records) == 1 and path in records[0].read_text()
  # Same size and mtime: the record stands, the CRC pass is not redone.
  stat = os.stat(path)
  _flip_byte(path)
  os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
  numpy_input.load_numpy(path)
  # A changed file is checked again.
  os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
  with pytest.raises(DataError, match="member x_train.npy is damaged"):
    numpy_input.load_numpy(path)
