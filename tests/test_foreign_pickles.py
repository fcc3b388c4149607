"""CIFAR-10's python files are pickles, and a run folder names the folder it
read them from (model_info.json's `data_dir`): reading them runs no code.
Only plain data and numpy arrays load; any other object is one line naming
the file, and the code it names never runs."""

import json
import os
import pickle

import numpy as np
import pytest

import framework
from framework.data import datasets
from helpers import assert_one_line_error, run_script, snapshot, tiny_mlp_config


class Payload:
  """Unpickled, runs a shell command that writes `marker`."""

  def __init__(self, marker):
    self.marker = marker

  def __reduce__(self):
    return os.system, (f"touch {self.marker}",)


def _crafted(folder, marker):
  """A CIFAR-10 layout whose every file is a payload (one nested in the
  dict a batch holds)."""
  os.makedirs(folder)
  for name in datasets.CIFAR10_FILES:
    content = Payload(marker)
    if name == "test_batch":
      content = {b"data": Payload(marker), b"labels": [0]}
    with open(os.path.join(folder, name), "wb") as f:
      pickle.dump(content, f, protocol=2)
  return str(folder)


def test_a_crafted_file_is_refused_without_running_it(tmp_path):
  marker = tmp_path / "marker"
  folder = _crafted(tmp_path / "cifar", marker)
  with pytest.raises(framework.DataError) as error:
    datasets.load_cifar10(folder)
  with pytest.raises(framework.DataError, match="test_batch"):
    datasets._cifar_batch(os.path.join(folder, "test_batch"))  # pylint: disable=protected-access
  assert not marker.exists()
  assert "data_batch_1" in str(error.value)
  assert "posix.system object, not plain data" in str(error.value)
  # Plain data and numpy arrays, as any pickle protocol writes them, load.
  data = {b"data": np.arange(6, dtype=np.uint8).reshape(2, 3),
          b"labels": [1, 2], b"batch_label": b"", b"names": ["a", b"b"]}
  for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
    (tmp_path / "batch").write_bytes(pickle.dumps(data, protocol=protocol))
    got = datasets._unpickle(str(tmp_path / "batch"))  # pylint: disable=protected-access
    np.testing.assert_array_equal(got["data"], data[b"data"])
    assert (got["labels"], got["batch_label"], got["names"]) == (
        [1, 2], b"", ["a", b"b"])


@pytest.fixture
def edited_run(tmp_path):
  """A run trained on CIFAR-10 whose model_info.json now names a folder of
  crafted pickles."""
  real = str(tmp_path / "real")
  data = datasets.synthetic(num_train=64, num_test=16, seed=1)
  datasets.write_cifar10(real, data.train_x, data.train_y, data.test_x,
                         data.test_y)
  model_dir = tmp_path / "run"
  from framework.app import experiment  # pylint: disable=g-import-not-at-top
  experiment.run(tiny_mlp_config(model_dir, dataset="cifar10", data_dir=real))
  marker = tmp_path / "marker"
  info_path = model_dir / "model_info.json"
  info = json.loads(info_path.read_text())
  assert info["data_dir"] == real
  info["data_dir"] = _crafted(tmp_path / "crafted", marker)
  info_path.write_text(json.dumps(info))
  return dict(model_dir=str(model_dir), marker=marker)


@pytest.mark.slow
@pytest.mark.parametrize("script,args", [("evaluate.py", []),
                                         ("predict.py", ["--index=0"])])
def test_evaluate_and_predict_run_no_code_from_the_run_folder(
    edited_run, script, args):
  before = snapshot(edited_run["model_dir"])
  proc = run_script(script, f"--model_dir={edited_run['model_dir']}", *args,
                    check=False)
  assert not edited_run["marker"].exists()
  assert_one_line_error(proc, script, "CIFAR-10 file", "crafted",
                        "not plain data", unchanged=before)
