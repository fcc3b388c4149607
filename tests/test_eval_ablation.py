"""scripts/benchmarks/eval_ablation.py: EMA and TTA at a finished run's step."""

import re

import pytest

from tests.helpers import assert_one_line_error, run_script, snapshot

# Learns to about 80 % in 32 steps (tests/test_time_to_accuracy.py's recipe).
RUN = ["--model=mlp", "--hidden_units=16", "--dataset=synthetic",
       "--strategy=default", "--global_batch_size=64", "--train_steps=32",
       "--optimizer=adam", "--learning_rate=0.001", "--steps_per_loop=8",
       "--eval_every=32", "--checkpoint_every=0", "--noexport_saved_model",
       "--ema_decay=0.5", "--eval_tta=flip"]


def _table(stdout):
  rows = dict(re.findall(r"^(ema|raw)\s+([\d.]+%\s+[\d.]+%)$", stdout, re.M))
  return {name: [float(v) / 100 for v in re.findall(r"([\d.]+)%", text)]
          for name, text in rows.items()}


@pytest.mark.slow
def test_the_ema_flip_figure_is_the_runs_own_final_evaluation(tmp_path):
  model_dir = tmp_path / "run"
  proc = run_script("train.py", *RUN, f"--model_dir={model_dir}")
  [final] = re.findall(r"final eval: .*'accuracy': ([0-9.e+-]+)",
                       proc.stdout + proc.stderr)
  out = run_script("benchmarks/eval_ablation.py",
                   f"--model_dir={model_dir}").stdout
  table = _table(out)
  assert set(table) == {"ema", "raw"}, out
  # EMA weights with flip TTA are what the run evaluated: same accuracy
  # (printed to 0.01 %).
  assert table["ema"][1] == pytest.approx(float(final), abs=5e-5)  # 0.01 %
  # Trained weights (chance is 10 %), and the raw weights are other
  # weights than their average.
  assert max(table["ema"] + table["raw"]) > 0.5
  assert table["raw"] != table["ema"]


@pytest.mark.slow
def test_a_run_without_ema_is_one_line(tmp_path):
  model_dir = tmp_path / "plain"
  run_script("train.py", *[a for a in RUN if not a.startswith("--ema")],
             "--train_steps=8", "--eval_every=8",
             f"--model_dir={model_dir}")
  before = snapshot(model_dir)
  proc = run_script("benchmarks/eval_ablation.py",
                    f"--model_dir={model_dir}", check=False)
  assert_one_line_error(proc, "eval_ablation.py", "model.raw.weights.h5",
                        unchanged=before)
