"""An infinite learning rate is refused like a zero one, not trained with."""

import pytest

from framework.core.config import OptimizerConfig
from framework.errors import ConfigError


@pytest.mark.parametrize("value", [float("inf"), 1e400])
def test_an_infinite_learning_rate_is_a_config_error(value):
  with pytest.raises(ConfigError, match=r"learning_rate=inf must be finite"):
    OptimizerConfig(learning_rate=value)


def test_a_finite_learning_rate_is_kept():
  assert OptimizerConfig(learning_rate=1e30).learning_rate == 1e30
