"""`--dataset=numpy` labels: a column of class indices ([N, 1]) trains as
classification; without class_names, one stray huge label is refused by
name instead of building a model of that many classes."""

import json

import numpy as np

from helpers import assert_one_line_error, run_script, snapshot

TRAIN = ("train.py", "--model=mlp", "--dataset=numpy", "--train_steps=2",
         "--global_batch_size=16", "--noexport_saved_model",
         "--data_dir=data.npz", "--model_dir=run")


def _write(path, y_train, y_test):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(len(y_train), 8)).astype(np.float32)
  np.savez(path, x_train=x, y_train=y_train, x_test=x[:len(y_test)],
           y_test=y_test)


def test_labels_of_shape_n_by_1_train_as_classes(tmp_path):
  y = (np.arange(64) % 3).astype(np.int64)
  _write(tmp_path / "data.npz", y[:, None], y[:16, None])
  run_script(*TRAIN, cwd=tmp_path)
  with open(tmp_path / "run" / "model_info.json") as f:
    info = json.load(f)
  assert info["num_classes"] == 3
  assert info["class_names"] == ["class_0", "class_1", "class_2"]


def test_one_stray_huge_label_is_one_line_naming_it(tmp_path):
  y = (np.arange(64) % 3).astype(np.int32)
  y[41] = 100_000_000
  _write(tmp_path / "data.npz", y, y[:16])
  before = snapshot(tmp_path / "run")
  proc = run_script(*TRAIN, cwd=tmp_path, check=False)
  assert_one_line_error(proc, "train.py", "y_train example 41",
                        "label 100000000", "4 distinct values", "class_names",
                        unchanged=before)
  assert not (tmp_path / "run").exists()


def test_a_model_refused_for_other_labels_is_told_their_shape(tmp_path):
  y = np.zeros((64, 5), np.int32)  # neither a class index nor a mask
  _write(tmp_path / "data.npz", y, y[:16])
  proc = run_script(*TRAIN, cwd=tmp_path, check=False)
  assert_one_line_error(proc, "train.py", "model='mlp'",
                        "its labels have shape [5] per example",
                        unchanged=snapshot(tmp_path / "run"))
