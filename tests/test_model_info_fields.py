"""A doctored model_info.json is one line naming the field, never a
traceback deep in a rebuild (`export.read_model_info`)."""

import json

import pytest

from framework.app import export
from framework.errors import CheckpointError

GOOD = {"model": "mlp", "model_options": {}, "input_shape": [4],
        "class_names": ["a", "b"], "num_classes": 2,
        "input_times_255": False}


@pytest.mark.parametrize("field,value", [
    ("model", 5), ("model", None), ("model_options", [1, 2]),
    ("input_shape", "abc"), ("input_shape", [0]), ("input_shape", [True]),
    ("class_names", [1, 2]), ("num_classes", "2"),
    ("label_smoothing", "x"), ("input_times_255", "yes"),
    ("model_import_dir", 3), ("run_plan", "x"),
    ("run_plan", {"model_parallel": "x"}),
    ("run_plan", {"model_parallel": {"mesh": 5}}),
])
def test_a_field_of_another_type_is_one_line_naming_it(tmp_path, field,
                                                       value):
  (tmp_path / export.MODEL_INFO_FILE).write_text(
      json.dumps(dict(GOOD, **{field: value})))
  with pytest.raises(CheckpointError) as error:
    export.read_model_info(str(tmp_path))
  message = str(error.value)
  assert "\n" not in message and field in message


def test_the_runs_own_file_reads(tmp_path):
  (tmp_path / export.MODEL_INFO_FILE).write_text(json.dumps(GOOD))
  assert export.read_model_info(str(tmp_path))["model"] == "mlp"


@pytest.mark.parametrize("text", ["[]", "null", "3",
                                  '"model input_shape class_names"'])
def test_a_file_that_holds_no_object_is_one_line(tmp_path, text):
  (tmp_path / export.MODEL_INFO_FILE).write_text(text)
  with pytest.raises(CheckpointError) as error:
    export.read_model_info(str(tmp_path))
  assert "\n" not in str(error.value)
  assert "not a JSON object" in str(error.value)


def test_a_relaunch_over_a_damaged_file_says_so_in_one_warning(tmp_path):
  """train.py writes model_info.json again from its own settings; what only
  the damaged file recorded is lost, which one warning line says."""
  from tests.helpers import run_script  # pylint: disable=g-import-not-at-top
  args = ["--model=mlp", "--dataset=synthetic", "--global_batch_size=8",
          f"--model_dir={tmp_path}"]
  run_script("train.py", *args, "--train_steps=1", timeout=300)
  (tmp_path / export.MODEL_INFO_FILE).write_text("{garbage")
  proc = run_script("train.py", *args, "--train_steps=2", timeout=300)
  warnings = [line for line in proc.stderr.splitlines()
              if export.MODEL_INFO_FILE in line and "written again" in line]
  assert len(warnings) == 1, proc.stderr[-2000:]
  assert export.read_model_info(str(tmp_path))["model"] == "mlp"
