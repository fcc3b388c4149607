"""`--recompute=every:K` with a split is one line whose advice also holds
under `--shard_parameters` (which takes only true or none)."""

import pytest

from framework.errors import ConfigError
from framework.model_parallel import ModelParallelConfig


def test_the_advice_names_what_shard_parameters_takes():
  with pytest.raises(ConfigError) as error:
    ModelParallelConfig(mesh="data:2,model:2", recompute="every:2")
  message = str(error.value)
  assert "recompute=every:2" in message and "\n" not in message
  assert "only true or none with --shard_parameters" in message
