"""The `--dataset=numpy` data contract (keys, dtypes, shapes, uint8 -> /255,
floats as given) is written where a user looks: the `--dataset` flag's help,
docs/guide/data.md, and the one-line error about a file that breaks it."""

import dataclasses
import os

import numpy as np
import pytest

from framework import settings
from framework.app.config import ExperimentConfig
from framework.data import numpy_input
from framework.errors import DataError
from helpers import ROOT

KEYS = ("x_train", "y_train", "x_test", "y_test", "class_names")


def _help(name):
  field, = [f for f in dataclasses.fields(ExperimentConfig) if f.name == name]
  return settings.info(field)["help"]


def test_dataset_flag_help_states_the_contract():
  text = _help("dataset")
  assert "numpy" in text
  for key in KEYS:
    assert key in text
  assert "uint8 divided by 255" in text and "other dtypes as given" in text
  assert "integer class indices" in text


def test_data_guide_states_the_contract():
  with open(os.path.join(ROOT, "docs", "guide", "data.md")) as f:
    guide = f.read()
  assert "--dataset=numpy" in guide
  for key in KEYS:
    assert f"`{key}`" in guide
  assert "float32 divided by 255, in [0, 1]" in guide
  assert "float32, the values as given" in guide
  assert "class indices 0..classes-1" in guide


@pytest.mark.parametrize("arrays,problem", [
    (dict(x_train=np.zeros((4, 2)), y_train=np.zeros(4, int),
          x_test=np.zeros((2, 2))), "has no y_test"),
    (dict(x_train=np.zeros((4, 2)), y_train=np.zeros(4),
          x_test=np.zeros((2, 2)), y_test=np.zeros(2, int)),
     "y_train is float64, y_test int64; give both integer class indices "
     "or both float targets"),
    (dict(x_train=np.array([["a", "b"]] * 4), y_train=np.zeros(4, int),
          x_test=np.array([["a", "b"]] * 2), y_test=np.zeros(2, int)),
     "features are numbers"),
    (dict(x_train=np.zeros((4, 2), np.uint8), y_train=np.zeros(4, int),
          x_test=np.zeros((2, 2), np.float32), y_test=np.zeros(2, int)),
     "x_train is uint8 but x_test is float32; save both with one dtype"),
])
def test_a_file_that_breaks_the_contract_is_one_line_naming_it(
    tmp_path, arrays, problem):
  path = str(tmp_path / "data.npz")
  np.savez(path, **arrays)
  with pytest.raises(DataError) as e:
    numpy_input.NumpyDataset(path)
  message = str(e.value)
  assert "\n" not in message
  assert problem in message
  assert message.endswith(f"(dataset=numpy: {numpy_input.CONTRACT})")
  for phrase in ("x_train, x_test", "uint8 divided by 255", "as given",
                 "integer class indices"):
    assert phrase in message
