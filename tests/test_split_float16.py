"""float16 loss scaling under a model split is one line saying so and
naming bfloat16, before anything is written (not the advice to override
compute_loss, meant for a user's own train_step)."""

import pytest

from tests import helpers


@pytest.mark.slow
def test_float16_with_a_split_is_one_line_naming_bfloat16(tmp_path):
  model_dir = tmp_path / "run"
  proc = helpers.run_script(
      "train.py", "--model=mlp", "--dataset=synthetic",
      "--global_batch_size=8", "--cpu_devices=2", "--model_parallel=pipeline",
      "--num_stages=2", "--mixed_precision=float16", "--train_steps=1",
      f"--model_dir={model_dir}", check=False)
  assert proc.returncode != 0
  errors = [line for line in proc.stderr.splitlines() if "error:" in line]
  assert errors == [
      "train.py: error: mixed_precision=float16 (dynamic loss scaling) is "
      "not supported with a model split; use mixed_precision=bfloat16 (no "
      "loss scale) or float32"], proc.stderr[-2000:]
  assert not model_dir.exists()
