"""A run record (goodput.json, run_config.json, model_info.json) replaced
by a huge file is refused by its size, not read whole into memory: one
line for the records a run needs, a warning for goodput.json."""

import json

import pytest

from framework.core import goodput
from framework.core.checkpoints import run_files
from framework.errors import CheckpointError


def _huge_but_valid(path):
  # Valid JSON, so that only its size can refuse it.
  with open(path, "w") as f:
    f.write('{"launches": 1, "pad": "')
    f.write("x" * (run_files.MAX_JSON_BYTES + 1))
    f.write('"}')


def test_a_huge_record_is_one_line_naming_its_size(tmp_path):
  path = tmp_path / "run_config.json"
  _huge_but_valid(path)
  with pytest.raises(CheckpointError, match=r"run_config\.json holds \d+ "
                     r"bytes.*; delete it"):
    run_files.read_json(str(path), "; delete it")


def test_a_huge_goodput_account_counts_from_this_launch(tmp_path):
  path = tmp_path / goodput.GOODPUT_FILE
  goodput.Goodput(str(tmp_path), start_time=100.0).write(now=130.0)
  record = json.loads(path.read_text())
  record["pad"] = "x" * (run_files.MAX_JSON_BYTES + 1)  # an intact account
  path.write_text(json.dumps(record))
  account = goodput.Goodput(str(tmp_path), start_time=200.0)
  assert account.launches == 1 and account.first_start == 200.0
