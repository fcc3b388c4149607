"""Your own data, end to end: a run trained on custom inputs is never scored
on other data, uint8 arrays of your own are scaled as the built-in data are
(so predict.py agrees with training), 16-feature arrays train, evaluate and
predict from the scripts, and a run of your own Controller is evaluated by
evaluate.py once `describe_run` recorded it."""

import importlib
import json

import sys

import numpy as np
import pytest
import tensorflow as tf

import framework
from framework.app import experiment
from helpers import final_eval, printed_metrics, run_script
from PIL import Image

USER_MODULE = '''
import keras

def build(input_shape, num_classes, width=32):
  inputs = keras.Input(input_shape)
  x = (keras.layers.GlobalAveragePooling2D()(inputs) if len(input_shape) == 3
       else inputs)
  x = keras.layers.Dense(width, activation="relu")(x)
  return keras.Model(inputs, keras.layers.Dense(num_classes)(x))
'''


@pytest.fixture(scope="module")
def user_nets(tmp_path_factory):
  """The user's `own_nets` module, importable from its own folder only."""
  folder = tmp_path_factory.mktemp("user")
  (folder / "own_nets.py").write_text(USER_MODULE)
  sys.path.insert(0, str(folder))
  try:
    yield importlib.import_module("own_nets")
  finally:
    sys.path.remove(str(folder))
    sys.modules.pop("own_nets", None)


def _brightness_images(n, seed):
  """uint8 32x32x3 images whose class (0..2) is their bright channel."""
  rng = np.random.RandomState(seed)
  labels = rng.randint(0, 3, n).astype(np.int64)
  images = rng.randint(10, 60, (n, 32, 32, 3))
  images[np.arange(n), :, :, labels] += 150
  return images.astype(np.uint8), labels


def _tabular(n, seed, weights=np.random.RandomState(7).randn(16, 3)):
  rng = np.random.RandomState(seed)
  x = rng.randn(n, 16).astype(np.float32)
  return x, np.argmax(x @ weights, 1).astype(np.int64)


@pytest.fixture(scope="module")
def custom_image_run(tmp_path_factory, user_nets):
  """experiment.run on the user's own uint8 arrays via custom inputs;
  config.dataset=synthetic gives only the classes."""
  tmp = tmp_path_factory.mktemp("custom")
  train_x, train_y = _brightness_images(256, 0)
  test_x, test_y = _brightness_images(64, 1)
  np.savez(tmp / "own.npz", x_train=train_x, y_train=train_y, x_test=test_x,
           y_test=test_y)

  def train_input(start_step):
    ds = tf.data.Dataset.from_tensor_slices((train_x, train_y))
    return ds.repeat().batch(32, drop_remainder=True).skip(start_step)

  def eval_input():
    return tf.data.Dataset.from_tensor_slices((test_x, test_y)).batch(32)

  model_dir = tmp / "run"
  config = framework.ExperimentConfig(
      dataset="synthetic", model_dir=str(model_dir), global_batch_size=32,
      train_steps=40, export_saved_model=False,
      optimizer=framework.OptimizerConfig(name="adam", learning_rate=2e-2),
      loop=framework.LoopConfig(train_steps=40, steps_per_loop=20))
  results = experiment.run(config, build_model=user_nets.build,
                           train_input=train_input, eval_input=eval_input)
  return dict(tmp=tmp, model_dir=str(model_dir), results=results,
              test_x=test_x, test_y=test_y)


def test_a_custom_input_run_is_not_scored_on_other_data(custom_image_run):
  run = custom_image_run
  assert run["results"]["accuracy"] == 1.0
  with open(f"{run['model_dir']}/model_info.json") as f:
    info = json.load(f)
  assert info["eval_input"] == "custom"
  assert info["input_preprocessing"] == "uint8/255"
  proc = run_script("evaluate.py", f"--model_dir={run['model_dir']}",
                    "--trust_model_code", check=False)
  assert proc.returncode == 1
  lines = proc.stderr.strip().splitlines()
  assert "custom eval_input" in lines[-1] and "--dataset" in lines[-1]
  assert "Traceback" not in proc.stderr


def test_told_the_data_evaluate_gives_the_runs_own_accuracy(custom_image_run):
  run = custom_image_run
  proc = run_script("evaluate.py", f"--model_dir={run['model_dir']}",
                    "--trust_model_code", "--dataset=numpy",
                    f"--data_dir={run['tmp'] / 'own.npz'}",
                    f"--eval_dir={run['tmp'] / 'eval'}")
  metrics = printed_metrics(proc.stdout)
  assert metrics["accuracy"] == pytest.approx(run["results"]["accuracy"])
  assert metrics["loss"] == pytest.approx(run["results"]["loss"], rel=1e-4)


def test_predict_on_a_custom_input_run_gives_its_probabilities(
    custom_image_run):
  # Trained on uint8 arrays, which the loop scaled as predict.py does.
  run = custom_image_run
  for index in (0, 1, 2):
    png = run["tmp"] / f"own{index}.png"
    Image.fromarray(run["test_x"][index]).save(png)
    out = run["tmp"] / f"p{index}.json"
    run_script("predict.py", f"--model_dir={run['model_dir']}",
               "--trust_model_code", f"--image={png}", f"--output_json={out}")
    summary = json.loads(out.read_text())
    assert summary["predicted_index"] == run["test_y"][index]
    assert max(summary["probabilities"].values()) > 0.9
  proc = run_script("predict.py", f"--model_dir={run['model_dir']}",
                    "--trust_model_code", "--index=0", check=False)
  assert proc.returncode == 1
  assert "custom eval_input" in proc.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_16_feature_arrays_train_evaluate_and_predict_from_the_scripts(
    tmp_path):
  train_x, train_y = _tabular(512, 0)
  test_x, test_y = _tabular(128, 1)
  np.savez(tmp_path / "tab.npz", x_train=train_x, y_train=train_y,
           x_test=test_x, y_test=test_y)
  run = tmp_path / "run"
  proc = run_script("train.py", "--model=mlp", "--hidden_units=32",
                    "--dataset=numpy", "--data_dir=tab.npz",
                    "--global_batch_size=32", "--train_steps=48",
                    "--export_saved_model=false", "--model_dir=run",
                    cwd=tmp_path)
  final = final_eval(proc.stderr)
  with open(run / "model_info.json") as f:
    assert json.load(f)["input_shape"] == [16]
  metrics = printed_metrics(run_script("evaluate.py", "--model_dir=run",
                                cwd=tmp_path).stdout)
  assert metrics["accuracy"] == pytest.approx(final["accuracy"])
  assert metrics["loss"] == pytest.approx(final["loss"], rel=1e-5)
  # predict.py --index: the float features as stored, not cast to uint8.
  from framework.app import prediction  # pylint: disable=g-import-not-at-top
  info, weights = prediction.resolve_model(str(run))
  model = prediction.load_model(info, weights)
  expected = tf.nn.softmax(model(test_x[5:6], training=False))[0].numpy()
  run_script("predict.py", "--model_dir=run", "--index=5",
             "--output_json=p.json", cwd=tmp_path)
  summary = json.loads((tmp_path / "p.json").read_text())
  got = [summary["probabilities"][f"class_{i}"] for i in range(3)]
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
  proc = run_script("predict.py", "--model_dir=run", "--image=p.json",
                    cwd=tmp_path, check=False)
  assert proc.returncode == 1 and "not images" in proc.stderr


def test_custom_16_feature_inputs_build_the_model_for_their_shape(
    tmp_path, user_nets):
  train_x, train_y = _tabular(128, 0)

  def train_input(start_step):
    ds = tf.data.Dataset.from_tensor_slices((train_x, train_y))
    return ds.repeat().batch(32, drop_remainder=True).skip(start_step)

  def eval_input():
    return tf.data.Dataset.from_tensor_slices((train_x, train_y)).batch(32)

  config = framework.ExperimentConfig(
      dataset="synthetic", model_dir=str(tmp_path / "a"),
      global_batch_size=32, train_steps=4, export_saved_model=False,
      loop=framework.LoopConfig(train_steps=4, steps_per_loop=4))
  results = experiment.run(config, build_model=user_nets.build,
                           train_input=train_input, eval_input=eval_input)
  assert results["examples"] == 128
  with open(tmp_path / "a" / "model_info.json") as f:
    assert json.load(f)["input_shape"] == [16]
  # Without eval_input it would evaluate on synthetic's 32x32x3 test split.
  config = framework.ExperimentConfig(
      dataset="synthetic", model_dir=str(tmp_path / "b"),
      global_batch_size=32, train_steps=4, export_saved_model=False)
  with pytest.raises(framework.ConfigError, match=r"\(16,\).*eval_input"):
    experiment.run(config, build_model=user_nets.build,
                   train_input=train_input)
  assert not (tmp_path / "b").exists()


@pytest.mark.slow
def test_a_controller_run_is_evaluated_by_evaluate_py(tmp_path, user_nets):
  train_x, train_y = _tabular(256, 0)
  test_x, test_y = _tabular(64, 1)
  np.savez(tmp_path / "tab.npz", x_train=train_x, y_train=train_y,
           x_test=test_x, y_test=test_y)
  strategy = framework.make_strategy("default")
  with strategy.scope():
    import keras  # pylint: disable=g-import-not-at-top
    model = user_nets.build((16,), 3, width=24)
    optimizer = keras.optimizers.Adam(1e-2)
  trainer = framework.Trainer(model, optimizer, strategy,
                              global_batch_size=32)
  model_dir = str(tmp_path / "ctl")
  controller = framework.Controller(
      trainer, framework.LoopConfig(train_steps=30, steps_per_loop=10),
      model_dir,
      train_input=lambda start: tf.data.Dataset.from_tensor_slices(
          (train_x, train_y)).repeat().batch(32, drop_remainder=True)
      .skip(start),
      eval_input=lambda: tf.data.Dataset.from_tensor_slices(
          (test_x, test_y)).batch(32))
  results = controller.run()
  framework.describe_run(model_dir, user_nets.build, dataset="numpy",
                         data_dir=str(tmp_path / "tab.npz"),
                         model_options={"width": 24})
  metrics = printed_metrics(run_script("evaluate.py", f"--model_dir={model_dir}",
                                "--trust_model_code").stdout)
  assert metrics["accuracy"] == pytest.approx(results["accuracy"])
  assert metrics["loss"] == pytest.approx(results["loss"], rel=1e-5)
  with pytest.raises(framework.ConfigError, match="module-level"):
    framework.describe_run(model_dir, lambda s, n: None, dataset="numpy",
                           data_dir=str(tmp_path / "tab.npz"))


def test_a_model_that_cannot_take_the_data_is_one_line(tmp_path):
  train_x, train_y = _tabular(64, 0)
  np.savez(tmp_path / "tab.npz", x_train=train_x, y_train=train_y,
           x_test=train_x, y_test=train_y)
  proc = run_script("train.py", "--model=cifar_cnn", "--dataset=numpy",
                    "--data_dir=tab.npz", "--global_batch_size=32",
                    "--train_steps=2", "--model_dir=run", cwd=tmp_path,
                    check=False)
  assert proc.returncode == 1
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith("train.py: error: model=cifar_cnn cannot be built")
  assert "(16,)" in last and "Traceback" not in proc.stderr
  assert not (tmp_path / "run").exists()
