"""A model that rescales its own input (Rescaling(1/255), a Normalization
adapted on 0-255 pixels) gets the 0-255 pixels it expects and a log line,
instead of training at chance on inputs scaled twice; and a run whose loss
stays at ln(classes) says so once, in one line naming the usual causes."""

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
