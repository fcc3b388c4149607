"""The best checkpoint under multi_worker_mirrored (2 worker processes):
every worker takes part in each best export, only the chief's is kept, and
early stopping ends both workers at the same step."""

import json
import os

import pytest

import cluster_utils as cu


@pytest.mark.slow
def test_two_workers_keep_one_best_and_stop_together(tmp_path):
  model_dir = str(tmp_path / "run")
  proc = cu.launch(cu.MLP + [
      "--strategy=multi_worker_mirrored", "--checkpoint_every=10",
      "--eval_every=5", "--train_steps=80", "--hidden_units=32",
      "--optimizer=sgd", "--learning_rate=0.05", "--lr_schedule=step",
      "--lr_step_boundaries=30", "--lr_step_decay=-1",
      "--best_metric=eval/accuracy", "--early_stopping_patience=2",
      "--export_saved_model=false", f"--model_dir={model_dir}"])
  output = proc.stdout + proc.stderr
  assert proc.returncode == 0, output[-3000:]
  with open(os.path.join(model_dir, "best", "best.json")) as f:
    best = json.load(f)
  with open(os.path.join(model_dir, "stopped_early.json")) as f:
    stopped = json.load(f)
  assert best["step"] < stopped["step"] < 80
  # The chief wrote best/ (worker 1 its part, in a folder it removed: no
  # save hung); both workers stopped at the same step, with the same reason.
  assert output.count(f"best eval/accuracy={best['value']:.4f} at step "
                      f"{best['step']}: wrote") == 1, output[-3000:]
  assert output.count(f"run ends at step {stopped['step']} of 80: "
                      f"{stopped['reason']}") == 2, output[-3000:]
  assert not [n for n in os.listdir(model_dir) if n.startswith(".tmp")]
