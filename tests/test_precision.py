"""Mixed precision: float16 loss scaling under the explicit all-reduce."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import framework
import models
from tests import shared_strategy
from framework import precision


def _one_step(data, precision_name, loss_scale_kwargs=None, steps=1):
  """Trains `steps` SGD steps on 2 replicas; returns (trainer, before, after)."""
  strategy = shared_strategy.mirrored()
  precision.set_precision(precision_name)
  try:
    keras.utils.set_random_seed(3)
    with strategy.scope():
      model = models.build_model("mlp", data.input_shape, 10,
                                 hidden_units=(32,))
      optimizer = framework.make_optimizer(
          framework.OptimizerConfig(name="sgd", learning_rate=0.5))
  finally:
    precision.set_precision("float32")
  loss_scale = None
  if loss_scale_kwargs is not None:
    loss_scale = precision.LossScale(strategy, **loss_scale_kwargs)
  trainer = framework.Trainer(model, optimizer, strategy, global_batch_size=32,
                              loss_scale=loss_scale)
  before = [w.numpy() for w in model.trainable_variables]
  trainer.train(iter(framework.distribute_train(strategy, data, 32)), steps)
  after = [w.numpy() for w in model.trainable_variables]
  return trainer, before, after


@pytest.fixture(scope="module")
def data():
  return framework.synthetic(num_train=96, num_test=8, image_shape=(4, 4, 3))


def test_float16_update_matches_float32(data):
  _, before32, after32 = _one_step(data, "float32")
  trainer, before16, after16 = _one_step(data, "float16", {})
  assert trainer.model.layers[-1].compute_dtype == "float16"
  for b32, a32, b16, a16 in zip(before32, after32, before16, after16):
    np.testing.assert_array_equal(b16, b32)  # same float32 master weights
    update32, update16 = a32 - b32, a16 - b16
    # float16 compute: the same update up to half-precision rounding.
    np.testing.assert_allclose(update16, update32,
                               atol=2e-3 * np.abs(update32).max() + 1e-6)
  assert float(trainer.loss_scale.scale.numpy()) == 2.0**15


def test_float16_overflow_skips_the_update_and_shrinks_the_scale(data):
  # loss * 1e30 overflows float16 in the backward pass.
  trainer, before, after = _one_step(data, "float16",
                                     {"initial_scale": 1e30}, steps=2)
  for b, a in zip(before, after):
    np.testing.assert_array_equal(a, b)
  assert int(trainer.optimizer.iterations.numpy()) == 0
  assert int(trainer.global_step.numpy()) == 2
  assert float(trainer.loss_scale.scale.numpy()) == pytest.approx(1e30 / 4)


def test_loss_scale_grows_after_good_steps(data):
  trainer, _, _ = _one_step(data, "float16",
                            {"initial_scale": 8.0, "growth_interval": 2},
                            steps=5)
  assert int(trainer.optimizer.iterations.numpy()) == 5
  assert float(trainer.loss_scale.scale.numpy()) == 32.0  # doubled twice
  assert int(trainer.loss_scale.good_steps.numpy()) == 1


def test_bfloat16_trains_with_float32_variables(data):
  trainer, before, after = _one_step(data, "bfloat16")
  assert trainer.model.layers[-1].compute_dtype == "bfloat16"
  assert all(w.dtype == np.float32 for w in after)
  assert any(not np.array_equal(a, b) for a, b in zip(after, before))


def test_unknown_precision_is_rejected():
  with pytest.raises(framework.ConfigError, match="mixed_precision='fp8'"):
    precision.set_precision("fp8")


def test_train_script_flags_reach_the_trainer(tmp_path):
  from tests.helpers import run_script  # pylint: disable=g-import-not-at-top
  run_script("train.py", "--model=mlp", "--dataset=synthetic",
             "--hidden_units=8", "--global_batch_size=32", "--train_steps=4",
             "--steps_per_loop=2", "--mixed_precision=float16",
             "--grad_accum_steps=2", "--augment=crop_flip",
             f"--model_dir={tmp_path}")
  names = dict(tf.train.list_variables(str(tmp_path)))
  # The loss scale is checkpointed, so a resumed float16 run keeps it.
  assert any(name.startswith("loss_scale/") for name in names), names
  reader = tf.train.load_checkpoint(str(tmp_path))
  assert reader.get_tensor("global_step/.ATTRIBUTES/VARIABLE_VALUE") == 4
