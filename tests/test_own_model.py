"""A user's own model by import path (`--model=module:function`), trained,
then evaluated and used for prediction by fresh processes that never saw the
user's directory; and `experiment.run` with a user's model and data."""

import glob
import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import framework
import framework.data.datasets  # noqa: F401  (the attribute chain below)
from framework.app import experiment
from models import registry
from helpers import ROOT, run_script
from shared_strategy import mirrored

USER_MODULE = '''
import keras

CALLS = []

def build(input_shape, num_classes, **options):
  """A functional model with an L2 regulariser; takes every option."""
  CALLS.append(sorted(options))
  inputs = keras.Input(input_shape)
  x = keras.layers.Flatten()(inputs)
  x = keras.layers.Dense(options["hidden_units"][0], activation="relu",
                         kernel_regularizer=keras.regularizers.L2(1e-4))(x)
  return keras.Model(inputs, keras.layers.Dense(num_classes)(x))

NOT_CALLABLE = 3
'''


def _train(cwd, model_dir, *args):
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
  env.pop("PYTHONPATH", None)  # the script finds the framework itself
  return subprocess.run(
      [sys.executable, os.path.join(ROOT, "scripts", "train.py"),
       "--dataset=synthetic", "--strategy=mirrored", "--cpu_devices=2",
       "--global_batch_size=32", "--train_steps=4", "--hidden_units=12",
       f"--model_dir={model_dir}", *args],
      cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def user_run(tmp_path_factory):
  """`--model=my_nets:build`, importable only from the user's directory."""
  user_dir = tmp_path_factory.mktemp("user")
  (user_dir / "my_nets.py").write_text(USER_MODULE)
  model_dir = str(tmp_path_factory.mktemp("runs") / "run")
  proc = _train(str(user_dir), model_dir, "--model=my_nets:build")
  assert proc.returncode == 0, proc.stderr[-3000:]
  return dict(user_dir=str(user_dir), model_dir=model_dir)


def test_import_path_trains_and_is_recorded(user_run):
  with open(os.path.join(user_run["model_dir"], "model_info.json")) as f:
    info = json.load(f)
  assert info["model"] == "my_nets:build"
  assert info["model_import_dir"] == user_run["user_dir"]
  assert os.path.isfile(os.path.join(user_run["model_dir"], "export",
                                     "saved_model.pb"))


@pytest.mark.slow
def test_evaluate_and_predict_rebuild_it_in_a_fresh_process(user_run,
                                                            tmp_path):
  # cwd is the repository and PYTHONPATH does not name the user's
  # directory: only model_info.json says where my_nets lives, which is
  # read only when trusted (evaluate.py). Named again (predict.py), the
  # module is the user's own, from their current folder.
  env = {"PYTHONPATH": None}
  proc = run_script("evaluate.py", f"--model_dir={user_run['model_dir']}",
                    "--trust_model_code", env=env)
  assert "accuracy" in proc.stdout
  png = str(tmp_path / "image.png")
  from PIL import Image  # pylint: disable=g-import-not-at-top
  Image.fromarray(np.random.default_rng(0).integers(
      0, 255, (32, 32, 3), dtype=np.uint8)).save(png)
  out = str(tmp_path / "prediction.json")
  run_script("predict.py", f"--model_dir={user_run['model_dir']}",
             "--model=my_nets:build", f"--image={png}",
             f"--output_json={out}", env=env, cwd=user_run["user_dir"])
  with open(out) as f:
    summary = json.load(f)
  assert summary["model"] == "my_nets:build"
  assert sum(summary["probabilities"].values()) == pytest.approx(1, abs=1e-4)


@pytest.mark.parametrize("model,message", [
    ("no_such_module:build", "no module named 'no_such_module'"),
    ("my_nets:missing", "module my_nets has no attribute 'missing'"),
])
def test_bad_import_path_is_one_line_and_writes_nothing(tmp_path, model,
                                                        message):
  (tmp_path / "my_nets.py").write_text(USER_MODULE)
  model_dir = tmp_path / "run"
  proc = _train(str(tmp_path), str(model_dir), f"--model={model}")
  assert proc.returncode == 1
  lines = proc.stderr.strip().splitlines()
  assert lines[-1].startswith("train.py: error: model=") and message in lines[
      -1], proc.stderr[-2000:]
  assert "Traceback" not in proc.stderr
  assert not model_dir.exists()


def test_registry_errors(tmp_path, monkeypatch):
  (tmp_path / "user_mod.py").write_text(USER_MODULE)
  monkeypatch.chdir(tmp_path)
  monkeypatch.setattr(sys, "path", list(sys.path))
  assert registry.get_builder("user_mod:build").__name__ == "build"
  assert registry.import_dir("user_mod:build") == str(tmp_path)
  with pytest.raises(framework.ConfigError, match="not a callable"):
    registry.get_builder("user_mod:NOT_CALLABLE")
  with pytest.raises(framework.ConfigError, match="known models: .*mlp"):
    registry.get_builder("no_such_name")
  with pytest.raises(framework.ConfigError, match="import path"):
    registry.get_builder("user_mod:")
  assert registry.import_path_of(build_tiny).endswith(":build_tiny")
  assert registry.import_path_of(lambda s, n: None) is None


def build_tiny(input_shape, num_classes, hidden_units=(4,)):
  inputs = keras.Input(input_shape)
  x = keras.layers.Dense(hidden_units[0], activation="relu")(
      keras.layers.Flatten()(inputs))
  return keras.Model(inputs, keras.layers.Dense(num_classes)(x))


def test_experiment_run_with_own_model_and_data(tmp_path):
  data = framework.data.datasets.synthetic(num_train=64, num_test=16, seed=3)

  def train_input(start_step):
    ds = tf.data.Dataset.from_tensor_slices(
        (data.train_x.astype(np.float32) / 255, data.train_y))
    return ds.repeat().batch(16, drop_remainder=True).skip(start_step)

  config = framework.ExperimentConfig(
      dataset="synthetic", model_dir=str(tmp_path), strategy="mirrored",
      global_batch_size=16, train_steps=3, export_saved_model=False,
      model_options={"hidden_units": (6,), "dropout": True},
      loop=framework.LoopConfig(train_steps=3, steps_per_loop=3))
  results = experiment.run(config, strategy=mirrored(), build_model=build_tiny,
                           train_input=train_input)
  assert results["examples"] > 0  # the synthetic dataset's test split
  with open(tmp_path / "model_info.json") as f:
    info = json.load(f)
  assert info["model"] == f"{build_tiny.__module__}:build_tiny"
  assert os.path.isfile(os.path.join(
      info["model_import_dir"], *build_tiny.__module__.split(".")) + ".py")
  assert info["model_options"]["hidden_units"] == [6]
  with pytest.raises(framework.ConfigError, match="module-level function"):
    experiment.run(config, strategy=mirrored(),
                   build_model=lambda shape, n: build_tiny(shape, n))


def test_own_model_and_data_example_runs(tmp_path):
  proc = run_script("examples/own_model_and_data.py",
                    f"--model_dir={tmp_path}", "--train_steps=20")
  assert "resumed from step 10" in proc.stdout
  assert "eval: accuracy=" in proc.stdout
  assert os.path.isfile(tmp_path / "ckpt-20.index")
  tags = set()
  for path in glob.glob(str(tmp_path / "train" / "events.*")):
    for event in tf.compat.v1.train.summary_iterator(path):
      tags.update(v.tag for v in event.summary.value)
  assert {"loss", "error_rate", "margin", "learning_rate"} <= tags
