"""The SavedModel export of a model with Keras's random layers (the random
preprocessing layers, Dropout, GaussianNoise, `keras.random` with a seed
generator) is written and predicts like the run's weights; an export that
fails anyway is one warning line after a successful training."""

import json
import logging
import os

import keras
import numpy as np
import tensorflow as tf

import helpers
from framework.app import experiment, export, prediction
from framework.data.inputs import to_float


class Noise(keras.layers.Layer):
  """Adds `keras.random.normal` noise drawn from its own seed generator, in
  inference too (a zero standard deviation there, so it predicts exactly)."""

  def __init__(self, stddev=0.1, **kwargs):
    super().__init__(**kwargs)
    self.stddev = stddev
    self.seeds = keras.random.SeedGenerator(7)

  def call(self, x, training=False):
    stddev = self.stddev if training else 0.0
    return x + keras.random.normal(keras.ops.shape(x), stddev=stddev,
                                   seed=self.seeds)


class Sampling(keras.layers.Layer):
  """A VAE's sampling: z = mean + exp(log_var / 2) * eps, always random."""

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.seeds = keras.random.SeedGenerator(3)

  def call(self, inputs):
    mean, log_var = inputs
    eps = keras.random.normal(keras.ops.shape(mean), seed=self.seeds)
    return mean + keras.ops.exp(0.5 * log_var) * eps


def random_layers_net(input_shape, num_classes):
  inputs = keras.Input(input_shape)
  x = inputs
  for layer in (keras.layers.RandomFlip(), keras.layers.RandomRotation(0.1),
                keras.layers.RandomZoom(0.1),
                keras.layers.RandomTranslation(0.1, 0.1),
                keras.layers.RandomContrast(0.2),
                keras.layers.GaussianNoise(0.05), Noise(),
                keras.layers.Conv2D(4, 3, strides=2, activation="relu"),
                keras.layers.Flatten(), keras.layers.Dropout(0.3),
                keras.layers.Dense(num_classes)):
    x = layer(x)
  return keras.Model(inputs, x)


def sampling_net(input_shape, num_classes):
  inputs = keras.Input(input_shape)
  x = keras.layers.Flatten()(inputs)
  z = Sampling()([keras.layers.Dense(4)(x), keras.layers.Dense(4)(x)])
  return keras.Model(inputs, keras.layers.Dense(num_classes)(z))


def _run(model_dir, build):
  config = helpers.tiny_mlp_config(
      model_dir, export_saved_model=True, model_options={},
      dataset_options=dict(num_train=64, num_test=32))
  experiment.run(config, build_model=build)
  with open(os.path.join(model_dir, export.MODEL_INFO_FILE)) as f:
    return json.load(f)


def _served(model_dir, images):
  served = tf.saved_model.load(os.path.join(model_dir, export.EXPORT_DIR))
  return served.signatures["serving_default"](images=tf.constant(images))


def _assert_served_like_the_weights(model_dir, info):
  """The export's probabilities on 8 images are the weights file's."""
  images = np.random.default_rng(0).integers(
      0, 256, (8, 32, 32, 3)).astype(np.uint8)
  served = _served(model_dir, images)["probabilities"].numpy()
  model = prediction.load_model(
      info, os.path.join(model_dir, export.WEIGHTS_FILE),
      trust_model_code=True)
  expected = tf.nn.softmax(model(to_float(tf.constant(images)),
                                 training=False)).numpy()
  np.testing.assert_allclose(served, expected, atol=1e-5)


def test_random_layers_export_and_predict_like_the_weights(tmp_path):
  model_dir = str(tmp_path / "run")
  info = _run(model_dir, random_layers_net)
  _assert_served_like_the_weights(model_dir, info)


def test_an_always_random_layer_exports(tmp_path):
  model_dir = str(tmp_path / "run")
  _run(model_dir, sampling_net)
  outputs = _served(model_dir, np.zeros((2, 32, 32, 3), np.uint8))
  probabilities = outputs["probabilities"].numpy()
  assert probabilities.shape == (2, 10)
  np.testing.assert_allclose(probabilities.sum(-1), 1, rtol=1e-5)


def test_a_failing_export_is_one_warning_after_training(
    tmp_path, monkeypatch, caplog):
  def fail(module, export_dir, **kwargs):
    del module, kwargs
    os.makedirs(os.path.join(export_dir, "variables"))  # a partial write
    raise KeyError("Failed to add concrete function: captures tensor x\n"
                   "which is not reachable from root")

  monkeypatch.setattr(tf.saved_model, "save", fail)
  model_dir = tmp_path / "run"
  with caplog.at_level(logging.WARNING):
    experiment.run(helpers.tiny_mlp_config(model_dir,
                                           export_saved_model=True))
  lines = [r.getMessage() for r in caplog.records
           if "SavedModel" in r.getMessage()]
  assert len(lines) == 1 and "\n" not in lines[0], lines
  assert "KeyError" in lines[0] and "not exported" in lines[0], lines
  assert (model_dir / export.WEIGHTS_FILE).is_file()
  assert not (model_dir / export.EXPORT_DIR).exists()
  assert not [p for p in os.listdir(model_dir) if "export" in p]


def adapted_net(input_shape, num_classes):
  """An unadapted Normalization first: the run adapts it on its data."""
  inputs = keras.Input(input_shape)
  x = keras.layers.Normalization(axis=None)(inputs)
  x = keras.layers.Flatten()(x)
  return keras.Model(inputs, keras.layers.Dense(num_classes)(x))


def test_the_export_uses_the_adapted_state(tmp_path):
  # The export once rebuilt the model and set its weights without the
  # Normalization reading them: it served the unadapted layer.
  model_dir = str(tmp_path / "run")
  info = _run(model_dir, adapted_net)
  _assert_served_like_the_weights(model_dir, info)
