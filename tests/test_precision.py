"""Mixed precision: float16 loss scaling under the explicit all-reduce."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import framework
import framework.core.optimizers  # noqa: F401  (the attribute chain below)
import framework.data.datasets  # noqa: F401  (the attribute chain below)
import framework.data.inputs  # noqa: F401  (the attribute chain below)
import models
from tests import shared_strategy
from framework.core import precision


def _one_step(data, precision_name, loss_scale_kwargs=None, steps=1,
              metrics=None):
  """Trains `steps` SGD steps on 2 replicas; returns (trainer, before, after).

  `metrics`, a dict, receives the steps' mean metrics (loss, ...)."""
  strategy = shared_strategy.mirrored()
  precision.set_precision(precision_name)
  try:
    keras.utils.set_random_seed(3)
    with strategy.scope():
      model = models.build_model("mlp", data.input_shape, 10,
                                 hidden_units=(32,))
      optimizer = framework.core.optimizers.make_optimizer(
          framework.OptimizerConfig(name="sgd", learning_rate=0.5))
  finally:
    precision.set_precision("float32")
  loss_scale = None
  if loss_scale_kwargs is not None:
    loss_scale = precision.LossScale(strategy, **loss_scale_kwargs)
  trainer = framework.Trainer(model, optimizer, strategy, global_batch_size=32,
                              loss_scale=loss_scale)
  before = [w.numpy() for w in model.trainable_variables]
  results = trainer.train(iter(framework.data.inputs.distribute_train(strategy, data, 32)),
                          steps)
  if metrics is not None:
    metrics.update({k: float(v) for k, v in results.items()})
  after = [w.numpy() for w in model.trainable_variables]
  return trainer, before, after


@pytest.fixture(scope="module")
def data():
  return framework.data.datasets.synthetic(num_train=96, num_test=8, image_shape=(4, 4, 3))


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


# bfloat16 keeps 8 significant bits (7 stored + 1 implicit): one rounding
# changes a value by at most 2**-8 of it.
BF16_UNIT = 2.0**-8


def test_bfloat16_computes_in_bfloat16_on_float32_variables(data):
  metrics32, metrics16 = {}, {}
  _, before32, after32 = _one_step(data, "float32", metrics=metrics32)
  trainer, before16, after16 = _one_step(data, "bfloat16", metrics=metrics16)
  model = trainer.model
  # Variables (and the optimizer's) stay float32: the master weights.
  assert {v.dtype for v in model.weights} == {"float32"}
  assert {v.dtype for v in trainer.optimizer.variables} <= {"float32",
                                                             "int64"}
  # The activations really are bfloat16, not just the declared policy.
  layers = keras.Model(model.inputs, [l.output for l in model.layers])
  outputs = layers([data.train_x[:4]])
  dense = [o for l, o in zip(model.layers, outputs)
           if isinstance(l, keras.layers.Dense)]
  assert [o.dtype for o in dense] == ["bfloat16"] * 2
  # One step from the same float32 weights on the same batch: the loss and
  # the updates match float32 up to bfloat16 rounding. The logits are
  # rounded once more than float32's (< 1 unit), so 4 units bound the loss
  # (measured: 0.2). Gradients pass through bf16 inputs, weights and
  # activations forward and back (a few units), and a ReLU input within
  # rounding of 0 switches that unit off for that example: single elements
  # of the first layer's update then differ by much more (measured: 19
  # units of the largest update), so each update is bounded as a whole, in
  # norm: 16 units (measured: at most 9.7, the hidden layer).
  assert metrics16["loss"] == pytest.approx(metrics32["loss"],
                                            rel=4 * BF16_UNIT)
  errors = []
  for b32, a32, b16, a16 in zip(before32, after32, before16, after16):
    np.testing.assert_array_equal(b16, b32)
    update32, update16 = a32 - b32, a16 - b16
    errors.append(np.linalg.norm(update16 - update32) /
                  np.linalg.norm(update32) / BF16_UNIT)
  assert max(errors) <= 16, errors
  # ... and the bfloat16 step did round: it is not the float32 step.
  assert min(errors) > 0, errors
  print(f"bfloat16 vs float32: loss {metrics16['loss']:.6f} vs "
        f"{metrics32['loss']:.6f}; update errors in units of 2**-8: "
        f"{[round(float(e), 2) for e in errors]}")


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
