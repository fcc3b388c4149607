"""A run file replaced by a directory (model_info.json, run_config.json,
metrics.jsonl) is one error naming it, not a TensorFlow traceback."""

import pytest

from framework.core import summaries
from framework.core.checkpoints import run_files
from framework.errors import CheckpointError, ModelDirError


def test_a_json_file_that_is_a_directory_is_one_error(tmp_path):
  path = tmp_path / "run_config.json"
  path.mkdir()
  with pytest.raises(CheckpointError, match="cannot read .*run_config.json"
                     ) as error:
    run_files.read_json(str(path), "; restore it")
  assert "\n" not in str(error.value)


def test_a_metrics_file_that_is_a_directory_is_one_error(tmp_path):
  path = tmp_path / summaries.METRICS_FILE
  path.mkdir()
  with pytest.raises(ModelDirError, match="cannot read .*metrics.jsonl"):
    summaries.JsonlSink(str(path)).restart(3)
