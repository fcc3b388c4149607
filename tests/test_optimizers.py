"""Optimizers by name and the learning-rate schedules."""

import keras
import numpy as np
import pytest

import framework
import framework.core.optimizers  # noqa: F401  (the attribute chain below)
from framework.core import optimizers


def lr(config, step):
  return float(optimizers.make_schedule(config)(step))


def test_warmup_then_cosine():
  config = framework.OptimizerConfig(learning_rate=0.1, schedule="cosine",
                                     warmup_steps=10, total_steps=110)
  assert lr(config, 0) == pytest.approx(0.01)
  assert lr(config, 9) == pytest.approx(0.1)
  assert lr(config, 60) == pytest.approx(0.05, rel=1e-4)
  assert lr(config, 110) == pytest.approx(0.0, abs=1e-7)


def test_step_schedule():
  config = framework.OptimizerConfig(learning_rate=1.0, schedule="step",
                                     step_boundaries=(5, 8), step_decay=0.5)
  assert [lr(config, s) for s in (0, 5, 6, 9)] == [1.0, 1.0, 0.5, 0.25]


@pytest.mark.parametrize("name,cls", [("sgd", keras.optimizers.SGD),
                                      ("momentum", keras.optimizers.SGD),
                                      ("adam", keras.optimizers.Adam),
                                      ("adamw", keras.optimizers.AdamW)])
def test_optimizers_by_name(name, cls):
  optimizer = framework.core.optimizers.make_optimizer(framework.OptimizerConfig(name=name))
  assert isinstance(optimizer, cls)
  if name == "momentum":
    assert optimizer.momentum == pytest.approx(0.9)


@pytest.mark.parametrize("kwargs,match", [
    (dict(name="lamb"), "optimizer='lamb'"),
    (dict(learning_rate=0.0), "learning_rate=0.0"),
    (dict(total_steps=-1), "total_steps=-1"),
    (dict(schedule="step"), "lr_step_boundaries"),
    (dict(schedule="step", step_boundaries=(8, 5)), "strictly increasing"),
])
def test_bad_configs(kwargs, match):
  with pytest.raises(framework.ConfigError, match=match):
    framework.OptimizerConfig(**kwargs)


def test_cosine_needs_the_run_length():
  # total_steps=0 means "the run's length", filled in by factory.build_model_and_optimizer.
  with pytest.raises(framework.ConfigError, match="total_steps"):
    optimizers.make_schedule(framework.OptimizerConfig(schedule="cosine"))
