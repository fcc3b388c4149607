"""A run_config.json that holds no JSON object (`[]`, `null`, a number) is
one error naming it, not a resume that silently skips the configuration
check."""

import pytest

from framework.core.checkpoints import manager
from framework.errors import CheckpointError


@pytest.mark.parametrize("text", ["[]", "null", "128", '"mlp"'])
def test_a_run_config_that_is_no_object_is_one_error(tmp_path, text):
  (tmp_path / manager.RUN_CONFIG_FILE).write_text(text)
  with pytest.raises(CheckpointError, match="run_config.json holds .*not a "
                     "JSON object.*delete it") as error:
    manager.read_run_config(str(tmp_path))
  assert "\n" not in str(error.value)


def test_the_runs_own_object_reads(tmp_path):
  (tmp_path / manager.RUN_CONFIG_FILE).write_text('{"model": "mlp"}')
  assert manager.read_run_config(str(tmp_path)) == {"model": "mlp"}
