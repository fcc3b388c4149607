"""A model that rescales its own input (Rescaling(1/255), a Normalization
adapted on 0-255 pixels) gets the 0-255 pixels it expects and a log line,
instead of training at chance on inputs scaled twice; and a run whose loss
stays at ln(classes) says so once, in one line naming the usual causes."""

import json
import logging
import math

import keras
import numpy as np
import pytest
import tensorflow as tf

import framework
from framework.app import experiment
from framework.core import actions
from models import input_scale, registry


def rescaling_first(input_shape, num_classes):
  inputs = keras.Input(input_shape)
  x = keras.layers.Rescaling(1 / 255)(inputs)
  x = keras.layers.Flatten()(x)
  return keras.Model(inputs, keras.layers.Dense(num_classes)(x))


def normalization_first(input_shape, num_classes):
  norm = keras.layers.Normalization(mean=127.5, variance=75.0 ** 2)
  return keras.Sequential([keras.Input(input_shape), norm,
                           keras.layers.Flatten(),
                           keras.layers.Dense(num_classes)])


def plain(input_shape, num_classes):
  return keras.Sequential([keras.Input(input_shape), keras.layers.Flatten(),
                           keras.layers.Dense(num_classes)])


@pytest.mark.parametrize("builder", [rescaling_first, normalization_first])
def test_a_model_that_rescales_gets_0_255_pixels_and_a_log_line(builder,
                                                                 caplog):
  caplog.set_level(logging.INFO)
  model = registry.call_builder(builder, (4, 4, 3), 5, {}, name="m:f")
  assert model.layers[1].name == input_scale.WRAPPER_LAYER
  pixels = np.random.default_rng(0).integers(0, 256, (2, 4, 4, 3))
  inner = model.layers[2]
  # The pipeline's [0, 1] input reaches the inner model as the pixels.
  np.testing.assert_allclose(model(pixels / 255.0).numpy(),
                             inner(pixels.astype(np.float32)).numpy(),
                             rtol=1e-4, atol=1e-4)
  lines = [r.getMessage() for r in caplog.records
           if "expects 0-255 pixels" in r.getMessage()]
  assert len(lines) == 1 and "\n" not in lines[0]
  assert f"starts with {input_scale.describe(input_scale.expects_pixels(inner))}" in lines[0]


def test_a_model_that_does_not_rescale_is_left_alone():
  model = registry.call_builder(plain, (4, 4, 3), 5, {}, name="m:f")
  assert input_scale.WRAPPER_LAYER not in [l.name for l in model.layers]


def test_efficientnet_gets_pixels():
  model = registry.build_model("keras.applications:EfficientNetB0",
                               (32, 32, 3), 10)
  assert model.layers[1].name == input_scale.WRAPPER_LAYER


def test_loss_at_chance_is_said_once(caplog):
  caplog.set_level(logging.WARNING)
  action = actions.LossAtChance(num_classes=10, global_batch_size=100,
                                examples_per_class=300)
  chance = math.log(10)
  action(10, {"loss": chance})  # 1000 examples: too early to tell
  assert not caplog.records
  action(30, {"loss": chance + 0.001})
  action(60, {"loss": chance})
  lines = [r.getMessage() for r in caplog.records]
  assert len(lines) == 1 and "\n" not in lines[0]
  for cause in ("scaled twice", "learning rate", "frozen"):
    assert cause in lines[0]


def test_a_learning_loss_says_nothing(caplog):
  caplog.set_level(logging.WARNING)
  action = actions.LossAtChance(num_classes=10, global_batch_size=100)
  action(30, {"loss": 1.7})
  assert not caplog.records


def zero_logits(input_shape, num_classes):
  return keras.Sequential([
      keras.Input(input_shape), keras.layers.Flatten(),
      keras.layers.Dense(num_classes, kernel_initializer="zeros",
                         trainable=False)])


def test_a_run_with_frozen_weights_warns_once(tmp_path, caplog):
  caplog.set_level(logging.WARNING)
  config = framework.ExperimentConfig(
      dataset="synthetic", model_dir=str(tmp_path), global_batch_size=64,
      train_steps=60, export_saved_model=False,
      loop=framework.LoopConfig(train_steps=60, steps_per_loop=20,
                                eval_steps=1))
  experiment.run(config, build_model=zero_logits)
  lines = [r.getMessage() for r in caplog.records
           if "still ln(classes)" in r.getMessage()]
  assert len(lines) == 1, lines


# What the data is decides, not a guess on the model: float features reach
# a model that starts with Normalization(mean=100) as they are.


def normalization_mean_100(input_shape, num_classes):
  return keras.Sequential([
      keras.Input(input_shape),
      keras.layers.Normalization(mean=100.0, variance=10.0 ** 2),
      keras.layers.Dense(num_classes)])


def _npz(path, dtype):
  rng = np.random.default_rng(0)
  labels = rng.integers(0, 2, 96).astype(np.int32)
  x = 100.0 + 10.0 * rng.standard_normal((96, 4)) + 15.0 * labels[:, None]
  x = np.clip(x, 0, 255).astype(dtype)
  np.savez(path, x_train=x[:64], y_train=labels[:64], x_test=x[64:],
           y_test=labels[64:])
  return str(path)


def _run_numpy(tmp_path, dtype):
  model_dir = tmp_path / f"run_{dtype.__name__}"
  config = framework.ExperimentConfig(
      dataset="numpy", data_dir=_npz(tmp_path / f"{dtype.__name__}.npz",
                                     dtype),
      model_dir=str(model_dir), global_batch_size=32, train_steps=2,
      export_saved_model=False,
      loop=framework.LoopConfig(train_steps=2, steps_per_loop=2,
                                summary_every=0, log_every=0))
  seen = {}
  experiment.run(config, build_model=normalization_mean_100,
                 prepare_controller=lambda c: seen.update(
                     model=c.trainer.model))
  info = json.loads((model_dir / "model_info.json").read_text())
  return seen["model"], info


def test_float_features_are_not_multiplied_by_255(tmp_path, caplog):
  caplog.set_level(logging.INFO)
  model, info = _run_numpy(tmp_path, np.float32)
  assert input_scale.WRAPPER_LAYER not in [l.name for l in model.layers]
  features = np.full((1, 4), 100.0, np.float32)
  # Normalization(mean=100) sees the feature as it is: 100 -> 0.
  norm = model.layers[0]
  np.testing.assert_allclose(norm(features).numpy(), 0.0, atol=1e-6)
  assert info[input_scale.RECORD] is False
  lines = [r.getMessage() for r in caplog.records
           if "expects 0-255 pixels" in r.getMessage()]
  assert len(lines) == 1 and "float32 features" in lines[0], lines
  assert "as it is" in lines[0]


def test_uint8_features_of_the_same_model_are(tmp_path):
  model, info = _run_numpy(tmp_path, np.uint8)
  assert model.layers[1].name == input_scale.WRAPPER_LAYER
  assert info[input_scale.RECORD] is True


# keras-io's "image classification from scratch": augmentation first,
# Rescaling(1/255) second.


def augmentation_then_rescaling(input_shape, num_classes):
  augment = keras.Sequential([keras.layers.RandomFlip("horizontal"),
                              keras.layers.RandomRotation(0.1)])
  inputs = keras.Input(input_shape)
  x = augment(inputs)
  x = keras.layers.Rescaling(1.0 / 255)(x)
  x = keras.layers.Conv2D(4, 3)(x)
  x = keras.layers.GlobalAveragePooling2D()(x)
  return keras.Model(inputs, keras.layers.Dense(num_classes)(x))


def nested_functional(input_shape, num_classes):
  inner_in = keras.Input(input_shape)
  x = keras.layers.RandomFlip("horizontal")(inner_in)
  x = keras.layers.Rescaling(1.0 / 255)(x)
  stem = keras.Model(inner_in, x)
  return keras.Sequential([keras.Input(input_shape), stem,
                           keras.layers.Flatten(),
                           keras.layers.Dense(num_classes)])


def rescaling_after_weights(input_shape, num_classes):
  return keras.Sequential([keras.Input(input_shape),
                           keras.layers.Dense(8),
                           keras.layers.Rescaling(1.0 / 255),
                           keras.layers.Flatten(),
                           keras.layers.Dense(num_classes)])


@pytest.mark.parametrize("builder", [augmentation_then_rescaling,
                                     nested_functional])
def test_rescaling_after_an_augmentation_is_found(builder):
  model = registry.call_builder(builder, (8, 8, 3), 5, {}, name="m:f")
  assert model.layers[1].name == input_scale.WRAPPER_LAYER
  inner = model.layers[2]
  pixels = np.random.default_rng(0).integers(0, 256, (2, 8, 8, 3))
  np.testing.assert_allclose(
      model(pixels / 255.0, training=False).numpy(),
      inner(pixels.astype(np.float32), training=False).numpy(),
      rtol=1e-4, atol=1e-4)


def test_rescaling_after_a_layer_with_weights_is_not_the_input_scale():
  model = registry.call_builder(rescaling_after_weights, (8, 8, 3), 5, {},
                                name="m:f")
  assert input_scale.WRAPPER_LAYER not in [l.name for l in model.layers]
