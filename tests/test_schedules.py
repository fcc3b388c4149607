"""One-cycle and linear-decay schedules, Nesterov momentum, batch scaling."""

import keras
import numpy as np
import pytest

import framework
import framework.core.optimizers  # noqa: F401  (the attribute chain below)
from framework import ConfigError
from framework.core import optimizers


def lr(config, step):
  return float(optimizers.make_schedule(config)(step))


def test_linear_decay_after_warmup():
  config = framework.OptimizerConfig(learning_rate=0.4, schedule="linear",
                                     warmup_steps=10, total_steps=110)
  assert lr(config, 0) == pytest.approx(0.04)
  assert lr(config, 9) == pytest.approx(0.4)
  assert lr(config, 10) == pytest.approx(0.4)
  assert lr(config, 60) == pytest.approx(0.2)
  assert lr(config, 110) == pytest.approx(0.0, abs=1e-7)
  assert lr(config, 500) == pytest.approx(0.0, abs=1e-7)


def test_linear_decay_to_a_floor():
  config = framework.OptimizerConfig(learning_rate=1.0, schedule="linear",
                                     total_steps=100, min_lr_ratio=0.1)
  assert lr(config, 0) == pytest.approx(1.0)
  assert lr(config, 50) == pytest.approx(0.55)
  assert lr(config, 100) == pytest.approx(0.1)


def test_onecycle_is_a_triangle_peaking_at_30_percent():
  config = framework.OptimizerConfig(learning_rate=1.0, schedule="onecycle",
                                     total_steps=100)
  values = np.array([lr(config, s) for s in range(101)])
  assert values.argmax() in (29, 30)
  assert values.max() == pytest.approx(1.0)
  assert lr(config, 0) == pytest.approx(1 / 30)
  assert lr(config, 14) == pytest.approx(0.5)
  assert lr(config, 65) == pytest.approx(0.5)
  assert lr(config, 100) == pytest.approx(0.0, abs=1e-7)
  # Its own warm-up length when given.
  short = framework.OptimizerConfig(learning_rate=1.0, schedule="onecycle",
                                    total_steps=100, warmup_steps=10)
  assert lr(short, 9) == pytest.approx(1.0)
  assert lr(short, 55) == pytest.approx(0.5)


@pytest.mark.parametrize("schedule", ["linear", "onecycle"])
def test_schedules_need_the_run_length(schedule):
  with pytest.raises(ConfigError, match="total_steps"):
    optimizers.make_schedule(framework.OptimizerConfig(schedule=schedule))
  with pytest.raises(ConfigError, match="warmup_steps=100"):
    optimizers.make_schedule(framework.OptimizerConfig(
        schedule=schedule, total_steps=100, warmup_steps=100))


def test_nesterov_momentum():
  optimizer = framework.core.optimizers.make_optimizer(framework.OptimizerConfig(
      name="momentum", learning_rate=0.1, nesterov=True))
  assert isinstance(optimizer, keras.optimizers.SGD) and optimizer.nesterov
  plain = framework.core.optimizers.make_optimizer(framework.OptimizerConfig(name="momentum"))
  assert not plain.nesterov
  with pytest.raises(ConfigError, match="nesterov=True needs"):
    framework.OptimizerConfig(name="adam", nesterov=True)


@pytest.mark.parametrize("scaling,expected", [("none", 0.1), ("linear", 0.2),
                                              ("sqrt", 0.1 * 2**0.5)])
def test_learning_rate_scaling(scaling, expected):
  config = framework.OptimizerConfig(learning_rate=0.1, lr_scaling=scaling,
                                     base_batch_size=256)
  scaled = config.scaled(512)
  assert scaled.learning_rate == pytest.approx(expected)
  assert scaled.scaled(512).learning_rate == pytest.approx(expected)
  with pytest.raises(ConfigError, match="lr_scaling"):
    framework.OptimizerConfig(lr_scaling="cubic")
