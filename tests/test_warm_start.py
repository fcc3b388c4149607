"""`init_checkpoint`: a run's weights from another run, onto other classes.

A CNN trained on 10 classes warm-starts a run on 3 classes
(`init_skip_mismatch`): at step 0 its convolution and hidden weights are
the source's, its new head is the fresh initialisation, and the log names
the skipped head. Its relaunch resumes from its own checkpoint. A run folder,
a checkpoint prefix and a `.weights.h5` file all work; bad sources are one
line before anything is written.
"""

import json
import logging
import os

import numpy as np
import pytest

import framework
import models
from framework.app import experiment, export
from framework.core.checkpoints import warm_start
from framework.errors import CheckpointError
from tests.helpers import assert_one_line_error, run_script, snapshot

SHAPE = (12, 12, 3)


class _Stop(Exception):
  """Ends a run in `prepare_controller`, after the warm start."""


def _npz(path, num_classes, seed):
  rng = np.random.default_rng(seed)
  np.savez(path, x_train=rng.uniform(0, 1, (32,) + SHAPE).astype(np.float32),
           y_train=rng.integers(0, num_classes, 32).astype(np.int32),
           x_test=rng.uniform(0, 1, (8,) + SHAPE).astype(np.float32),
           y_test=np.arange(8, dtype=np.int32) % num_classes)
  return str(path)


def _config(model_dir, data, **kwargs):
  return framework.ExperimentConfig(
      model="cifar_cnn", dataset="numpy", data_dir=data,
      model_dir=str(model_dir), global_batch_size=8, train_steps=2,
      model_options={"dropout": False}, export_saved_model=False,
      loop=framework.LoopConfig(train_steps=2, steps_per_loop=2), **kwargs)


def _weights_at_start(config, stop=True):
  """The model's weights after the run restored or warm-started (step 0 of
  training), and the controller."""
  seen = {}

  def capture(controller):
    seen["weights"] = [w.numpy() for w in controller.trainer.model.weights]
    seen["controller"] = controller
    if stop:
      raise _Stop()

  try:
    experiment.run(config, prepare_controller=capture)
  except _Stop:
    pass
  return seen["weights"], seen["controller"]


def _source_weights(run_dir, num_classes=10):
  model = models.build_model("cifar_cnn", SHAPE, num_classes, dropout=False)
  model.load_weights(os.path.join(run_dir, export.WEIGHTS_FILE))
  return [w.numpy() for w in model.weights]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
  """A 2-step run on 10 classes, and a 3-class data file."""
  root = tmp_path_factory.mktemp("warm")
  ten = _npz(root / "ten.npz", 10, seed=1)
  three = _npz(root / "three.npz", 3, seed=2)
  experiment.run(_config(root / "source", ten))
  return root, str(root / "source"), three


def _check_fine_tuned(weights, source_weights, fresh):
  # Same layers in the same order; the head (last kernel and bias) differs.
  assert len(weights) == len(source_weights) == len(fresh)
  for mine, theirs in zip(weights[:-2], source_weights[:-2]):
    np.testing.assert_array_equal(mine, theirs)
  assert weights[-2].shape == (512, 3) and source_weights[-2].shape == (
      512, 10)
  for mine, new in zip(weights[-2:], fresh[-2:]):
    np.testing.assert_array_equal(mine, new)
  # The body did move from the initialisation (so equality means restored).
  assert not np.array_equal(weights[0], fresh[0])


@pytest.mark.parametrize("form", ["run_folder", "prefix", "weights_h5"])
def test_fine_tune_onto_other_classes(source, form, tmp_path, caplog):
  root, run_dir, three = source
  init = {"run_folder": run_dir, "prefix": os.path.join(run_dir, "ckpt-2"),
          "weights_h5": os.path.join(run_dir, export.WEIGHTS_FILE)}[form]
  fresh, _ = _weights_at_start(_config(tmp_path / "fresh", three))
  with caplog.at_level(logging.INFO):
    weights, controller = _weights_at_start(_config(
        tmp_path / "tuned", three, init_checkpoint=init,
        init_skip_mismatch=True))
  assert controller.restored_from is None
  _check_fine_tuned(weights, _source_weights(run_dir), fresh)
  skipped = [r.getMessage() for r in caplog.records
             if "init_checkpoint: skipped" in r.getMessage()]
  assert len(skipped) == 2, skipped
  if form == "weights_h5":
    assert all("layers/dense_1/vars/" in line for line in skipped), skipped
  else:
    assert ["kernel" in skipped[0], "bias" in skipped[1]] == [True, True]
    assert all("/dense" in line and "[512, 10] in the source, [512, 3] here"
               in line or "[10] in the source, [3] here" in line
               for line in skipped), skipped


def test_relaunch_resumes_its_own_checkpoint_not_the_init(source, tmp_path):
  root, run_dir, three = source
  config = _config(tmp_path / "tuned", three, init_checkpoint=run_dir,
                   init_skip_mismatch=True)
  experiment.run(config)
  info = json.loads((tmp_path / "tuned" / "model_info.json").read_text())
  record = info["init_checkpoint"]
  assert record["source"] == os.path.join(run_dir, "ckpt-2")
  assert record["restored"] == len(_source_weights(run_dir)) - 2
  assert len(record["skipped"]) == 2 and record["excluded"] == []
  tuned = _source_weights(str(tmp_path / "tuned"), num_classes=3)
  # The same command again: it restores ckpt-2 of its own run.
  weights, controller = _weights_at_start(config)
  assert controller.restored_from == str(tmp_path / "tuned" / "ckpt-2")
  for mine, trained in zip(weights, tuned):
    np.testing.assert_array_equal(mine, trained)
  assert not np.array_equal(weights[0], _source_weights(run_dir)[0])
  # ... and keeps the first launch's record.
  info = json.loads((tmp_path / "tuned" / "model_info.json").read_text())
  assert info["init_checkpoint"] == record


def test_exclude_keeps_fresh_values(source, tmp_path):
  _, run_dir, three = source
  fresh, _ = _weights_at_start(_config(tmp_path / "fresh", three))
  weights, _ = _weights_at_start(_config(
      tmp_path / "tuned", three, init_checkpoint=run_dir,
      init_skip_mismatch=True, init_exclude=r"/dense(_\d+)?/"))
  source_weights = _source_weights(run_dir)
  # Everything up to the dense layers restored; dense and head fresh.
  np.testing.assert_array_equal(weights[4], source_weights[4])
  for mine, new in zip(weights[-4:], fresh[-4:]):
    np.testing.assert_array_equal(mine, new)
  assert not np.array_equal(weights[4], fresh[4])


def test_without_skip_mismatch_the_head_is_an_error(source, tmp_path):
  _, run_dir, three = source
  model = models.build_model("cifar_cnn", SHAPE, 3, dropout=False)
  before = [w.numpy() for w in model.weights]
  with pytest.raises(CheckpointError, match=r"do not match, e\.g\. .*dense"
                     r".*init_skip_mismatch"):
    warm_start.restore_weights(model, run_dir)
  for now, then in zip(model.weights, before):  # nothing assigned
    np.testing.assert_array_equal(now.numpy(), then)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["missing", "empty_folder", "damaged",
                                  "matches_nothing", "bad_regex"])
def test_bad_source_is_one_line_and_writes_nothing(source, case, tmp_path):
  root, run_dir, three = source
  model_dir = tmp_path / "run"
  model_dir.mkdir()
  (model_dir / "notes.txt").write_text("mine")
  extra = ["--init_skip_mismatch"]
  if case == "missing":
    init, fragments = str(tmp_path / "nowhere"), ["does not exist"]
  elif case == "empty_folder":
    (tmp_path / "empty").mkdir()
    init, fragments = str(tmp_path / "empty"), ["without a TF checkpoint"]
  elif case == "damaged":
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    for name in os.listdir(run_dir):
      if name.startswith("ckpt-2."):
        data = (root / "source" / name).read_bytes()
        (damaged / name).write_bytes(data[:len(data) // 2] if "data-" in name
                                     else data)
    init, fragments = str(damaged / "ckpt-2"), ["damaged"]
  elif case == "matches_nothing":
    # An MLP's weights file: none of its variables fits the CNN.
    mlp = models.build_model("mlp", SHAPE, 5, hidden_units=(7,))
    mlp.save_weights(str(tmp_path / "mlp.weights.h5"))
    init, fragments = str(tmp_path / "mlp.weights.h5"), ["matches none"]
  else:
    init, fragments = run_dir, ["init_exclude='('", "regular expression"]
    extra.append("--init_exclude=(")
  before = snapshot(model_dir)
  proc = run_script(
      "train.py", "--model=cifar_cnn", "--dropout=false", "--dataset=numpy",
      f"--data_dir={three}", f"--model_dir={model_dir}",
      "--global_batch_size=8", "--train_steps=2", "--export_saved_model=false",
      f"--init_checkpoint={init}", *extra, check=False,
      env={"TF_CONFIG": None})
  assert_one_line_error(proc, "train.py", *fragments, unchanged=before)
