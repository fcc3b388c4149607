"""What a run records means the same from any folder and on any relaunch:
relative paths, a run finished at its target, an allowed configuration
change, a model whose code changed, a batch larger than the data."""

import json
import logging
import os

import numpy as np
import pytest
import tensorflow as tf

import framework
import framework.data.datasets  # noqa: F401  (the attribute chain below)
from framework import ExperimentConfig, LoopConfig
from framework.app import evaluation, experiment
from helpers import run_script


def _config(model_dir, **kwargs):
  loop = kwargs.pop("loop", {})
  return ExperimentConfig(**{
      "model": "mlp", "dataset": "synthetic", "model_dir": str(model_dir),
      "global_batch_size": 32, "train_steps": 4, "export_saved_model": False,
      "model_options": dict(hidden_units=(8,)),
      "loop": LoopConfig(train_steps=1, steps_per_loop=5, summary_every=0,
                         log_every=0, **loop), **kwargs})


def _cifar(data_dir, num_test, seed):
  rng = np.random.default_rng(seed)
  framework.data.datasets.write_cifar10(
      str(data_dir), rng.integers(0, 255, (64, 32, 32, 3)),
      rng.integers(0, 10, 64), rng.integers(0, 255, (num_test, 32, 32, 3)),
      rng.integers(0, 10, num_test))


def test_relative_data_dir_means_the_runs_data_from_any_folder(
    tmp_path, monkeypatch):
  a, b, c = (tmp_path / n for n in "abc")
  _cifar(a / "data", num_test=40, seed=0)
  _cifar(b / "data", num_test=8, seed=1)  # the same relative path, other data
  c.mkdir()
  monkeypatch.chdir(a)
  experiment.run(_config("run", dataset="cifar10", data_dir="data",
                         train_steps=2))
  run_dir = str(a / "run")
  with open(os.path.join(run_dir, "model_info.json")) as f:
    assert json.load(f)["data_dir"] == str(a / "data")
  for folder in (b, c):
    monkeypatch.chdir(folder)
    result = evaluation.Evaluator(
        evaluation.EvalConfig(model_dir=run_dir)).evaluate()
    assert result.metrics["examples"] == 40, folder
  # predict.py from b: test image 20 exists only in the run's own data.
  proc = run_script("predict.py", f"--model_dir={run_dir}", "--index=20",
                    cwd=str(b))
  assert "image: CIFAR-10 test #20" in proc.stdout


def test_a_run_finished_at_its_target_stays_finished(tmp_path, caplog):
  model_dir = tmp_path / "run"
  config = _config(model_dir, train_steps=20, loop=dict(
      eval_every=5, checkpoint_every=0, stop_at_accuracy=0.01))
  experiment.run(config)
  assert tf.train.latest_checkpoint(str(model_dir)).endswith("ckpt-5")
  with open(model_dir / "target_reached.json") as f:
    record = json.load(f)
  assert record["step"] == 5 and record["train_steps"] == 20
  before = sorted(os.listdir(model_dir))
  eval_events = sorted(os.listdir(model_dir / "eval"))
  caplog.set_level(logging.INFO)
  caplog.clear()
  results = experiment.run(config)  # the same settings: nothing to do
  assert results == record["metrics"]
  assert "Already finished: accuracy" in caplog.text
  assert "time_to_target_seconds" not in caplog.text
  assert "Saved checkpoint" not in caplog.text
  assert sorted(os.listdir(model_dir)) == before
  assert sorted(os.listdir(model_dir / "eval")) == eval_events
  # A higher target than the accuracy reached continues the run.
  caplog.clear()
  experiment.run(_config(model_dir, train_steps=10, loop=dict(
      eval_every=5, checkpoint_every=0, stop_at_accuracy=1.0)))
  assert tf.train.latest_checkpoint(str(model_dir)).endswith("ckpt-10")
  # More steps continue it too (the same target stops it at its next eval).
  experiment.run(dataclasses_replace(config, train_steps=30))
  assert tf.train.latest_checkpoint(str(model_dir)).endswith("ckpt-15")


def dataclasses_replace(config, **kwargs):
  import dataclasses  # pylint: disable=g-import-not-at-top
  return dataclasses.replace(config, **kwargs)


def test_allowed_config_change_is_recorded_in_model_info(tmp_path, caplog):
  model_dir = tmp_path / "run"
  experiment.run(_config(model_dir))
  caplog.set_level(logging.INFO)
  experiment.run(_config(model_dir, global_batch_size=64,
                         allow_config_change=True))  # finished: no training
  with open(model_dir / "model_info.json") as f:
    info = json.load(f)
  assert info["global_batch_size"] == 64
  assert info["config_changes"] == [
      {"step": 4, "global_batch_size": {"was": 32, "now": 64}}]
  assert "records the change at step 4" in caplog.text
  # Kept by later writes.
  experiment.run(_config(model_dir, global_batch_size=64, train_steps=6,
                         allow_config_change=True))
  with open(model_dir / "model_info.json") as f:
    assert json.load(f)["config_changes"][0]["step"] == 4


TANH_MLP = '''
import keras

def build(input_shape, num_classes, hidden_units=(8,)):
  return keras.Sequential([
      keras.Input(input_shape), keras.layers.Flatten(),
      keras.layers.Dense(hidden_units[0], activation="ACTIVATION"),
      keras.layers.Dense(num_classes)])
'''


def test_model_code_edited_to_other_activations_is_a_config_change(
    tmp_path, monkeypatch):
  monkeypatch.syspath_prepend(str(tmp_path))
  module = tmp_path / "edited_net.py"
  module.write_text(TANH_MLP.replace("ACTIVATION", "relu"))
  model_dir = tmp_path / "run"
  experiment.run(_config(model_dir, model="edited_net:build"))
  with open(model_dir / "run_config.json") as f:
    assert len(json.load(f)["model_fingerprint"]) == 16
  experiment.run(_config(model_dir, model="edited_net:build",
                         train_steps=6))  # the same code resumes
  module.write_text(TANH_MLP.replace("ACTIVATION", "tanh"))
  import importlib, sys  # pylint: disable=g-import-not-at-top,multiple-imports
  importlib.reload(sys.modules["edited_net"])
  with pytest.raises(framework.CheckpointError,
                     match=r"model_fingerprint was .*the model's code changed"):
    experiment.run(_config(model_dir, model="edited_net:build",
                           train_steps=8))


def test_a_batch_larger_than_the_data_leaves_nothing(tmp_path):
  model_dir = tmp_path / "new"
  with pytest.raises(framework.ConfigError,
                     match="global_batch_size=1000000 is larger than"):
    experiment.run(_config(model_dir, global_batch_size=1000000))
  assert not model_dir.exists()


def test_more_steps_for_a_run_that_met_its_target_train_them(tmp_path,
                                                             caplog):
  model_dir = tmp_path / "run"
  config = _config(model_dir, train_steps=20, optimizer=framework.
                   OptimizerConfig(schedule="onecycle"), loop=dict(
                       eval_every=5, checkpoint_every=0,
                       stop_at_accuracy=0.01))
  experiment.run(config)
  assert tf.train.latest_checkpoint(str(model_dir)).endswith("ckpt-5")
  with open(model_dir / "target_reached.json") as f:
    first = json.load(f)
  caplog.set_level(logging.INFO)
  caplog.clear()
  experiment.run(dataclasses_replace(config, train_steps=30))
  # All 30 steps, not one more evaluation and a stop at the same target.
  assert tf.train.latest_checkpoint(str(model_dir)).endswith("ckpt-30")
  assert "without stopping at that target again" in caplog.text
  assert "not reached" not in caplog.text
  with open(model_dir / "target_reached.json") as f:
    assert json.load(f) == first  # the first time to target, kept
  with open(model_dir / "model_info.json") as f:
    changes = json.load(f)["config_changes"]
  assert changes == [{"step": 5, "train_steps": {"was": 20, "now": 30},
                      "lr_schedule": {"was": "onecycle over 20 steps",
                                      "now": "onecycle over 30 steps"}}]
  assert "schedule now spans 30 steps" in caplog.text
