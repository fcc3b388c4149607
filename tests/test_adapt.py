"""A builder's unadapted preprocessing layer (keras-io's `Normalization`)
is adapted once, on the run's own training data as the layer receives it,
before the first step; the checkpoints keep its state, and a resume and
evaluate.py restore it instead of adapting again."""

import os
import re

import keras
import numpy as np
import pytest

from framework.app import experiment
from framework.data import datasets
from framework.errors import ConfigError
from helpers import final_eval, printed_metrics, run_script, tiny_mlp_config

# A ViT-style start: the Normalization first in a nested augmentation model.
USER_MODULE = '''
import keras

def build(input_shape, num_classes):
  augmentation = keras.Sequential(
      [keras.layers.Normalization(name="norm"),
       keras.layers.RandomFlip("horizontal")], name="data_augmentation")
  inputs = keras.Input(input_shape)
  x = keras.layers.Flatten()(augmentation(inputs))
  return keras.Model(inputs, keras.layers.Dense(num_classes)(x))
'''

FLAGS = ("--model=my_vit:build", "--dataset=synthetic", "--strategy=mirrored",
         "--cpu_devices=2", "--global_batch_size=32", "--log_every=0",
         "--summary_every=0", "--noexport_saved_model")
ENV = {"PYTHONPATH": None}


def _train(user_dir, model_dir, steps):
  proc = run_script("train.py", *FLAGS, f"--train_steps={steps}",
                    f"--model_dir={model_dir}", env=ENV, cwd=user_dir)
  digest = re.search(r"final weights sha256=(\w+)", proc.stderr).group(1)
  return proc, digest


def _adapted_state(user_dir, model_dir):
  """The Normalization's (mean, variance) in the run's latest checkpoint,
  restored into a freshly built (unadapted) model."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  spec = importlib.util.spec_from_file_location(
      "my_vit_copy", os.path.join(user_dir, "my_vit.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  model = module.build((32, 32, 3), 10)
  tf.train.Checkpoint(model=model).restore(
      tf.train.latest_checkpoint(model_dir)).expect_partial()
  norm = model.get_layer("data_augmentation").get_layer("norm")
  return norm.adapt_mean.numpy(), norm.adapt_variance.numpy()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  user_dir = tmp_path_factory.mktemp("user")
  (user_dir / "my_vit.py").write_text(USER_MODULE)
  model_dir = str(tmp_path_factory.mktemp("runs") / "run")
  proc, digest = _train(str(user_dir), model_dir, 4)
  return dict(user_dir=str(user_dir), model_dir=model_dir, proc=proc,
              digest=digest)


@pytest.mark.slow
def test_normalization_learns_the_training_data_as_the_model_gets_it(run):
  assert "adapted Normalization 'norm' on 2048 training examples" in (
      run["proc"].stderr)
  # What the model gets: the uint8 images divided by 255.
  pixels = datasets.synthetic().train_x.astype(np.float64) / 255
  mean, variance = _adapted_state(run["user_dir"], run["model_dir"])
  np.testing.assert_allclose(mean, pixels.mean(axis=(0, 1, 2)), atol=1e-5)
  np.testing.assert_allclose(variance, pixels.var(axis=(0, 1, 2)), atol=1e-5)


@pytest.mark.slow
def test_evaluate_restores_the_state_and_gives_the_runs_final_loss(run):
  mean, _ = _adapted_state(run["user_dir"], run["model_dir"])
  assert np.all(mean > 0.1), mean  # adapted, not the initial zeros
  proc = run_script("evaluate.py", f"--model_dir={run['model_dir']}",
                    "--trust_model_code", env=ENV)
  assert "adapted" not in proc.stderr  # restored, not adapted again
  assert printed_metrics(proc.stdout)["loss"] == pytest.approx(
      final_eval(run["proc"].stderr)["loss"], rel=1e-4)


@pytest.mark.slow
def test_a_resume_continues_bit_for_bit(run, tmp_path):
  model_dir = str(tmp_path / "resumed")
  _train(run["user_dir"], model_dir, 2)
  proc, digest = _train(run["user_dir"], model_dir, 4)
  assert "adapted" not in proc.stderr  # restored from the checkpoint
  assert digest == run["digest"]
  mean, _ = _adapted_state(run["user_dir"], model_dir)
  assert np.all(mean > 0.1), mean


def with_discretization(input_shape, num_classes):
  inputs = keras.Input(input_shape)
  x = keras.layers.Discretization(num_bins=4, name="bins")(inputs)
  x = keras.layers.Flatten()(x)
  return keras.Model(inputs, keras.layers.Dense(num_classes)(x))


def test_state_no_checkpoint_keeps_is_one_line_naming_the_layer(tmp_path):
  model_dir = tmp_path / "run"
  with pytest.raises(ConfigError, match=r"layer 'bins' \(Discretization\) "
                     r"is not adapted") as error:
    experiment.run(tiny_mlp_config(model_dir),
                   build_model=with_discretization)
  assert "\n" not in str(error.value)
  assert not model_dir.exists()  # nothing written
