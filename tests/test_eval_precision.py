"""evaluate.py evaluates in the run's own compute precision, so a bfloat16
run's final evaluation comes out again to the last digit."""

import json

import pytest

from helpers import final_eval, printed_metrics, run_script


@pytest.mark.slow
def test_evaluate_reproduces_a_bfloat16_runs_final_eval(tmp_path):
  proc = run_script("train.py", "--model=mlp", "--hidden_units=32",
                    "--dataset=synthetic", "--global_batch_size=32",
                    "--train_steps=30", "--mixed_precision=bfloat16",
                    "--export_saved_model=false", "--model_dir=run",
                    cwd=tmp_path)
  final = final_eval(proc.stderr)
  with open(tmp_path / "run" / "model_info.json") as f:
    assert json.load(f)["mixed_precision"] == "bfloat16"
  out = run_script("evaluate.py", "--model_dir=run", cwd=tmp_path).stdout
  metrics = printed_metrics(out)
  # float32 evaluation of the same weights differs in the 3rd-4th digit.
  assert metrics["loss"] == pytest.approx(final["loss"], abs=2e-6)
  assert metrics["accuracy"] == pytest.approx(final["accuracy"], abs=1e-9)
