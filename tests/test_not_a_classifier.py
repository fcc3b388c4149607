"""Models that are not classifiers: unlabeled or float-target `--dataset=numpy`
data trains with a Trainer subclass whose `task = "custom"` and whose
`compute_loss` defines the loss (an autoencoder, a regression), through
train.py, evaluate.py and the Python API; a classifier on such data, or a
model of several outputs on classes, is one line naming what it saw."""

import json
import os
import re
import textwrap

import numpy as np
import pytest

from helpers import assert_one_line_error, printed_metrics, run_python
from helpers import run_script, snapshot

# A model function of several outputs and its trainer, in a module of their
# own (evaluate.py imports the trainer; the script that trains is __main__).
PARTS = textwrap.dedent('''
    import keras
    import tensorflow as tf
    import framework

    def build(input_shape, num_classes):
      del num_classes  # not a classifier
      inputs = keras.Input(input_shape)
      hidden = keras.layers.Dense(16, activation="tanh")(inputs)
      z_mean = keras.layers.Dense(2, name="z_mean")(hidden)
      z_log_var = keras.layers.Dense(2, name="z_log_var")(hidden)
      decoded = keras.layers.Dense(16, activation="tanh")(z_mean)
      reconstruction = keras.layers.Dense(input_shape[-1],
                                          name="reconstruction")(decoded)
      return keras.Model(inputs, [reconstruction, z_mean, z_log_var])

    class AutoencoderTrainer(framework.Trainer):
      task = "custom"

      def compute_loss(self, batch):
        features = batch  # unlabeled: the features alone
        reconstruction, z_mean, z_log_var = self.model(features,
                                                       training=True)
        error = tf.reduce_sum(tf.square(features - reconstruction), axis=-1)
        kl = -0.5 * tf.reduce_sum(1.0 + z_log_var - tf.square(z_mean)
                                  - tf.exp(z_log_var), axis=-1)
        return error + 0.01 * kl, {"reconstruction": error}
    ''')

SCRIPT = textwrap.dedent('''
    from distloop_cli import cli
    cli.quiet_startup()
    cli.import_tensorflow_quietly()
    from distloop_cli import train
    import ae_parts

    def main(argv):
      del argv
      train.run_main(trainer_cls=ae_parts.AutoencoderTrainer)

    if __name__ == "__main__":
      cli.run_app(main)
    ''')


def _unlabeled(path, rows=128):
  rng = np.random.default_rng(0)
  # Points near a 2-D plane in 8-D: an autoencoder of 2 codes learns them.
  codes = rng.normal(size=(rows, 2)).astype(np.float32)
  x = codes @ rng.normal(size=(2, 8)).astype(np.float32)
  np.savez(path, x_train=x, x_test=x[:40])


def _train_flags(steps):
  return ("--model=ae_parts:build", "--dataset=numpy", "--data_dir=data.npz",
          "--model_dir=run", f"--train_steps={steps}",
          "--global_batch_size=16", "--learning_rate=0.05",
          "--optimizer=adam")


def _evaluate(folder):
  proc = run_script("evaluate.py", "--model_dir=run", "--trust_model_code",
                    cwd=folder)
  return printed_metrics(proc.stdout)


def test_an_autoencoder_trains_on_unlabeled_data_and_evaluates(tmp_path):
  (tmp_path / "ae_parts.py").write_text(PARTS)
  (tmp_path / "train_ae.py").write_text(SCRIPT)
  _unlabeled(tmp_path / "data.npz")
  env = {"PYTHONPATH": str(tmp_path)}
  proc = run_python("train_ae.py", *_train_flags(1), cwd=tmp_path, env=env)
  assert proc.returncode == 0, proc.stderr[-3000:]
  with open(tmp_path / "run" / "model_info.json") as f:
    info = json.load(f)
  assert info["task"] == "custom"
  assert info["trainer"] == "ae_parts:AutoencoderTrainer"
  assert info["class_names"] == []
  first = _evaluate(tmp_path)
  proc = run_python("train_ae.py", *_train_flags(60), cwd=tmp_path, env=env)
  assert proc.returncode == 0, proc.stderr[-3000:]
  last = _evaluate(tmp_path)
  assert set(first) == {"loss", "reconstruction"}  # no accuracy
  assert last["loss"] < 0.5 * first["loss"], (first, last)
  # The trainer is the run's code: imported only when trusted.
  proc = run_script("evaluate.py", "--model_dir=run", "--model=ae_parts:build",
                    cwd=tmp_path, env=env, check=False)
  assert_one_line_error(proc, "evaluate.py", "ae_parts:AutoencoderTrainer",
                        "--trust_model_code")


def test_a_classifier_on_unlabeled_data_is_one_line(tmp_path):
  _unlabeled(tmp_path / "data.npz")
  before = snapshot(tmp_path / "run")
  proc = run_script("train.py", "--model=mlp", "--dataset=numpy",
                    "--data_dir=data.npz", "--model_dir=run",
                    "--train_steps=2", "--global_batch_size=16",
                    cwd=tmp_path, check=False)
  assert_one_line_error(proc, "train.py", "dataset=numpy at ",
                        "data.npz has no labels (no y_train", "model='mlp'",
                        "task = 'custom'",
                        unchanged=before)


def test_a_regression_on_float_targets_runs_from_python(tmp_path):
  # pylint: disable=g-import-not-at-top
  import tensorflow as tf
  import framework
  from framework.app import experiment
  from framework.errors import ConfigError
  from helpers import tiny_mlp_config

  rng = np.random.default_rng(1)
  x = rng.normal(size=(256, 4)).astype(np.float32)
  y = (x @ np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32))  # [N, 1]
  np.savez(tmp_path / "data.npz", x_train=x, y_train=y, x_test=x[:64],
           y_test=y[:64])

  class Regression(framework.Trainer):
    task = "custom"

    def compute_loss(self, batch):
      features, targets = batch
      predictions = self.model(features, training=True)
      return tf.reduce_mean(tf.square(predictions - targets), axis=-1), {}

  def config(steps, model_dir):
    return tiny_mlp_config(
        model_dir, dataset="numpy", data_dir=str(tmp_path / "data.npz"),
        train_steps=steps, model_options=dict(hidden_units=()),
        optimizer=framework.OptimizerConfig(name="sgd", learning_rate=0.05))

  # The mlp's one output for one class: a linear model of one unit.
  with pytest.raises(ConfigError, match="float targets"):
    experiment.run(config(2, tmp_path / "refused"))
  assert not (tmp_path / "refused").exists()
  start = experiment.run(config(1, tmp_path / "short"), Regression)
  end = experiment.run(config(200, tmp_path / "long"), Regression)
  assert "accuracy" not in end
  assert end["examples"] == 64
  assert end["loss"] < 0.01 * start["loss"], (start, end)


def test_a_model_of_several_outputs_is_refused_naming_them():
  # pylint: disable=g-import-not-at-top
  import keras
  from models import registry
  from framework.errors import ConfigError

  inputs = keras.Input((4,))
  model = keras.Model(inputs, [keras.layers.Dense(2, name="z_mean")(inputs),
                               keras.layers.Dense(3, name="logits")(inputs)])
  with pytest.raises(ConfigError) as error:
    registry.check_outputs("vae", model, 2, "numpy")
  message = str(error.value)
  assert "has 2 outputs (z_mean (None, 2), logits (None, 3))" in message
  assert "task = 'custom'" in message
  assert "outputs (None, 2) logits" not in message


TRACKED_PARTS = textwrap.dedent('''
    import keras
    import tensorflow as tf
    import framework

    def build(input_shape, num_classes):
      del num_classes
      inputs = keras.Input(input_shape)
      return keras.Model(inputs, keras.layers.Dense(2)(inputs))

    class DecoderTrainer(framework.Trainer):
      """keras-io's VAE set-up: the encoder is the run's model, the decoder
      tracked; evaluation goes through both."""
      task = "custom"

      def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        with self.strategy.scope():
          self.decoder = keras.Sequential(
              [keras.Input((2,)), keras.layers.Dense(8)])
        self.track(decoder=self.decoder)

      def compute_loss(self, batch):
        decoded = self.decoder(self.model(batch, training=True))
        return tf.reduce_sum(tf.square(batch - decoded), axis=-1), {}
    ''')


def test_evaluate_restores_a_tracked_decoder(tmp_path):
  # evaluate.py once restored the model only: the decoder was a new random
  # one at every call, and the printed loss another each time.
  (tmp_path / "ae_parts.py").write_text(TRACKED_PARTS)
  (tmp_path / "train_ae.py").write_text(
      SCRIPT.replace("AutoencoderTrainer", "DecoderTrainer"))
  _unlabeled(tmp_path / "data.npz")
  env = {"PYTHONPATH": str(tmp_path)}
  proc = run_python("train_ae.py", *_train_flags(10), cwd=tmp_path, env=env)
  assert proc.returncode == 0, proc.stderr[-3000:]
  final = float(re.search(r"final eval: \{'loss': ([0-9.e-]+)",
                          proc.stderr + proc.stdout).group(1))
  for _ in range(2):
    assert abs(_evaluate(tmp_path)["loss"] - final) <= 1e-5 * final
  # predict.py reads classes: a custom run is one line, not a traceback.
  proc = run_script("predict.py", "--model_dir=run", "--trust_model_code",
                    "--index=0", cwd=tmp_path, env=env, check=False)
  assert_one_line_error(proc, "predict.py", "task=custom")


def test_an_unreached_tracked_model_leaves_no_run_folder(tmp_path):
  # Found at the first trace, once the run had begun writing: the folder
  # the run created goes again (bad input leaves model_dir as it was).
  parts = TRACKED_PARTS.replace(
      "decoded = self.decoder(self.model(batch, training=True))",
      "decoded = tf.tile(self.model(batch, training=True), [1, 4])")
  assert "tf.tile" in parts
  (tmp_path / "ae_parts.py").write_text(parts)
  (tmp_path / "train_ae.py").write_text(
      SCRIPT.replace("AutoencoderTrainer", "DecoderTrainer"))
  _unlabeled(tmp_path / "data.npz")
  proc = run_python("train_ae.py", *_train_flags(3), cwd=tmp_path,
                    env={"PYTHONPATH": str(tmp_path)})
  assert_one_line_error(proc, "train_ae.py", "track(decoder=...)",
                        "the loss reaches none")
  assert not (tmp_path / "run").exists()
