"""A loss written on `Trainer.compute_loss` gets every step feature; a
`train_step` override that would silently drop one is refused in one line.

Runs on the 2 logical CPU devices of tests/conftest.py.
"""

import os
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import framework
import framework.data.datasets  # noqa: F401  (the attribute chain below)
import framework.data.inputs  # noqa: F401  (the attribute chain below)
import framework.core.optimizers  # noqa: F401  (the attribute chain below)
from framework.core import precision
from framework.core import trainer as trainer_lib
from tests import shared_strategy
from tests.helpers import ROOT

GLOBAL_BATCH = 32


def readme_trainer():
  """The LabelSmoothingTrainer of docs/guide/custom_step.md, which README.md
  shows verbatim."""
  guide = open(os.path.join(ROOT, "docs", "guide", "custom_step.md")).read()
  code = re.search(r"```python\n(class LabelSmoothingTrainer.*?)```", guide,
                   re.S).group(1)
  assert code in open(os.path.join(ROOT, "README.md")).read()
  namespace = {"framework": framework, "tf": tf}
  exec(code, namespace)  # pylint: disable=exec-used
  return namespace["LabelSmoothingTrainer"]


def build_model():
  # BatchNorm normalises each micro-batch on its own, so the weights show
  # whether the step really accumulated micro-batches.
  return keras.Sequential([
      keras.Input((4, 4, 3)), keras.layers.Flatten(), keras.layers.Dense(16),
      keras.layers.BatchNormalization(), keras.layers.ReLU(),
      keras.layers.Dense(10)])


@pytest.fixture(scope="module")
def data():
  return framework.data.datasets.synthetic(num_train=192, num_test=8, image_shape=(4, 4, 3))


def train(make_trainer, data, *, precision_name="float32", steps=5,
          **options):
  """`steps` steps on 2 replicas; returns (weights, trainer)."""
  strategy = shared_strategy.mirrored()
  precision.set_precision(precision_name)
  try:
    keras.utils.set_random_seed(5)
    with strategy.scope():
      model = build_model()
      optimizer = framework.core.optimizers.make_optimizer(
          framework.OptimizerConfig(name="momentum", learning_rate=0.05))
  finally:
    precision.set_precision("float32")
  if precision_name == "float16":
    options["loss_scale"] = precision.LossScale(strategy)
  trainer = make_trainer(model, optimizer, strategy,
                         global_batch_size=GLOBAL_BATCH, **options)
  trainer.train(iter(framework.data.inputs.distribute_train(strategy, data,
                                                GLOBAL_BATCH)), steps)
  return [w.numpy() for w in model.weights], trainer


def test_readme_step_equals_the_builtin_step_with_every_feature(data):
  precision_name = "float16"
  options = dict(grad_accum_steps=4, precision_name=precision_name)
  builtin, builtin_trainer = train(
      framework.Trainer, data,
      loss_fn=trainer_lib.smoothed_sparse_categorical_loss(0.1), **options)
  custom, custom_trainer = train(readme_trainer(), data, **options)
  assert int(custom_trainer.optimizer.iterations.numpy()) == 5
  for a, b in zip(custom, builtin):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
  assert custom_trainer.model.layers[1].compute_dtype == "float16"
  assert float(custom_trainer.loss_scale.scale.numpy()) == float(
      builtin_trainer.loss_scale.scale.numpy())
  # Accumulation mattered: the whole batch at once trains other weights.
  whole, _ = train(readme_trainer(), data, precision_name=precision_name)
  assert max(float(np.max(np.abs(a - b))) for a, b in zip(whole, custom)) > 1e-4


class OwnStep(framework.Trainer):
  """A whole step of its own, correct without accumulation or float16."""

  def train_step(self, batch):
    grads, metrics = self.compute_gradients(batch)
    grads, _ = self.clip_by_global_norm(self.all_reduce(grads))
    self.apply_gradients(grads)
    return metrics


class NeverApplies(framework.Trainer):
  """Updates the weights itself, bypassing `apply_gradients`."""

  def train_step(self, batch):
    _, metrics = self.compute_gradients(batch)
    return metrics


@pytest.mark.parametrize("options, message", [
    (dict(grad_accum_steps=4), "grad_accum_steps=4: OwnStep overrides "
     "train_step, which does the gradient accumulation; override "
     "compute_loss instead"),
    (dict(precision_name="float16"), "loss_scale=float16: OwnStep overrides "
     "train_step, which does the float16 loss scaling"),
])
def test_a_train_step_override_that_drops_a_feature_is_one_line(
    data, options, message):
  with pytest.raises(framework.ConfigError) as error:
    train(OwnStep, data, steps=1, **options)
  assert str(error.value).startswith(message)
  assert "\n" not in str(error.value)


def test_a_train_step_override_that_declares_a_feature_is_allowed(data):
  declared = type("Declared", (OwnStep,),
                  {"train_step_handles": ("grad_accum_steps",)})
  _, trainer = train(declared, data, steps=1, grad_accum_steps=4)
  assert int(trainer.optimizer.iterations.numpy()) == 1


@pytest.mark.parametrize("options, feature", [
    (dict(ema_decay=0.9), "ema_decay (the EMA of the weights)"),
    (dict(nan_policy="skip"), "nan_policy=skip"),
])
def test_ema_and_nan_skip_need_apply_gradients(data, options, feature):
  with pytest.raises(framework.ConfigError) as error:
    train(NeverApplies, data, steps=1, **options)
  assert str(error.value).startswith(
      f"{feature}: NeverApplies.train_step never calls "
      "self.apply_gradients")
  # An override that does call it keeps the EMA.
  _, trainer = train(OwnStep, data, steps=2, ema_decay=0.9)
  assert int(trainer.ema.num_updates.numpy()) == 2
