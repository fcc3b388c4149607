"""Every schedule's optimizer has a Keras config: a split's copies on a
mesh's data axis build their optimizers from `optimizer.get_config()`."""

import warnings

import keras
import pytest

import framework
from framework.core import optimizers
from framework.core.config import SCHEDULES


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("name", ["momentum", "adamw"])
def test_the_optimizer_config_round_trips(schedule, name):
  config = framework.OptimizerConfig(
      name=name, schedule=schedule, learning_rate=0.1, warmup_steps=2,
      total_steps=20, step_boundaries=(5,))
  optimizer = optimizers.make_optimizer(config)
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # Keras warns when it serializes a lambda
    copy_config = dict(optimizer.get_config(), learning_rate=0.0)
  copy = type(optimizer).from_config(copy_config)
  assert float(copy.learning_rate) == 0.0


def test_cosine_after_warmup_is_keras_cosine_shifted():
  config = framework.OptimizerConfig(learning_rate=0.1, schedule="cosine",
                                     warmup_steps=10, total_steps=110)
  schedule = optimizers.make_schedule(config)
  cosine = keras.optimizers.schedules.CosineDecay(0.1, decay_steps=100)
  for step in (10, 11, 50, 109, 110, 200):
    assert float(schedule(step)) == float(cosine(step - 10))
