"""scripts/benchmarks/time_to_accuracy.py end to end on a tiny recipe (an MLP
on synthetic data): the per-seed table, the median, the ablation table and
the files; the figures are read from the runs, never asserted as timings."""

import json
import re
import statistics
import subprocess
import sys

import pytest
from PIL import Image

from tests import helpers
from tests.helpers import assert_one_line_error, run_script, snapshot

SCRIPT = "benchmarks/time_to_accuracy.py"
# 2048 synthetic training examples in batches of 64: 32 steps per epoch;
# Adam 1e-3 passes 50 % within the first evaluation (step 8).
TINY = ["--model=mlp", "--hidden_units=16", "--dataset=synthetic",
        "--strategy=default", "--global_batch_size=64", "--train_steps=32",
        "--optimizer=adam", "--learning_rate=0.001", "--steps_per_loop=8",
        "--eval_every=8", "--summary_every=8", "--log_every=8",
        "--checkpoint_every=0", "--noexport_saved_model", "--ema_decay=0.5",
        "--stop_at_accuracy=0.5"]


def _recipe(tmp_path, lines=TINY):
  path = tmp_path / "tiny.cfg"
  path.write_text("\n".join(["# a tiny recipe", *lines, ""]))
  return path


def _row(stdout, label):
  match = re.search(rf"^{label}\s+(yes|no)\s+(\S+)(?: s)?\s+(\S+)(?: s)?\s+"
                    rf"([\d.]+) s\s+([\d.]+) % \(([\d.]+)\)\s+([\d.]+)"
                    rf"\s+(\S+)\s+(\S+)$", stdout, re.M)
  assert match, f"no row {label!r} in:\n{stdout}"
  return match.groups()[:-2]


def _peak_column(stdout, label):
  line = re.search(rf"^{label}\s+(yes|no)\s.*$", stdout, re.M).group(0)
  return line.split()[-2]


def _dtype_column(stdout, label):
  line = re.search(rf"^{label}\s+(yes|no)\s.*$", stdout, re.M).group(0)
  return line.split()[-1]


@pytest.mark.slow
def test_two_seeds_reach_the_target_with_an_ablation(tmp_path):
  results = tmp_path / "results"
  proc = run_script(SCRIPT, f"--recipe={_recipe(tmp_path)}", "--seeds=0,1",
                    f"--work_dir={tmp_path / 'work'}",
                    f"--results_dir={results}", "--ablate=no_ema",
                    "--peak_matmul_size=256", timeout=600)
  out = proc.stdout
  assert "time to 50.00 % test accuracy" in out
  runs = {s: json.loads((results / f"tiny_seed{s}.json").read_text())
          for s in (0, 1)}
  for seed, figures in runs.items():
    reached, time_to_target, _, wall, best, best_epoch, epochs = _row(
        out, f"seed {seed}")
    # The machine's matmul rate, measured before the run, is reported.
    assert figures["matmul_peak_gflops"] > 0
    assert float(_peak_column(out, f"seed {seed}")) == pytest.approx(
        figures["matmul_peak_gflops"], abs=0.5)
    # And the compute dtype (the tiny recipe sets none: train.py's float32).
    assert figures["precision"] == "float32" == _dtype_column(
        out, f"seed {seed}")
    assert reached == "yes" and figures["reached"]
    # Stopped at the first evaluation reaching 50 % (32 steps per epoch).
    evaluations = figures["evaluations"]
    accuracies = [e["accuracy"] for e in evaluations]
    assert accuracies[-1] >= 0.5 > max(accuracies[:-1], default=0)
    assert [e["step"] for e in evaluations] == list(
        range(8, 8 * len(evaluations) + 1, 8))
    assert float(epochs) == figures["epochs_run"] == evaluations[-1][
        "step"] / 32
    assert float(best_epoch) == figures["epochs_run"]
    assert float(best) == pytest.approx(100 * figures["best_accuracy"],
                                        abs=0.005)
    assert figures["best_accuracy"] >= 0.5
    assert float(time_to_target) == pytest.approx(
        figures["time_to_target_seconds"], abs=0.05)
    assert float(wall) == pytest.approx(figures["wall_seconds"], abs=0.05)
    # Same clock origin: the evaluation ends just before the target is
    # recorded; the launch and the whole process include the imports.
    elapsed = [e["elapsed_seconds"] for e in evaluations]
    assert 0 < elapsed[0] and elapsed == sorted(elapsed)
    assert elapsed[-1] <= figures["time_to_target_seconds"]
    assert figures["time_to_target_seconds"] <= (
        figures["launch_to_target_seconds"]) <= figures["wall_seconds"]
    for axis in ("seconds", "epochs"):
      with Image.open(results / f"tiny_seed{seed}_{axis}.png") as image:
        assert image.size == (900, 560)
  median = statistics.median(r["time_to_target_seconds"]
                             for r in runs.values())
  match = re.search(r"^median time to target: ([\d.]+) s \(2 of 2 seeds "
                    r"reached 50.00 %\)$", out, re.M)
  assert match, out
  assert float(match.group(1)) == pytest.approx(median, abs=0.05)
  summary = json.loads((results / "tiny_summary.json").read_text())
  assert summary["median_time_to_target_seconds"] == pytest.approx(median)
  assert summary["seeds"] == [0, 1] and summary["seeds_reached"] == 2
  assert re.search(r"^goal:\s+median time to target <= 300 s: met$", out,
                   re.M)
  assert re.search(r"^milestone: median time to target <= 600 s: met$", out,
                   re.M)
  # The ablation: seed 0 without the EMA (--ema_decay=0 unsets the
  # recipe's), its delta in seconds against the full recipe's seed 0.
  variant = json.loads((results / "tiny_no_ema_seed0.json").read_text())
  info = json.loads((tmp_path / "work" / "no_ema_seed_0" /
                     "model_info.json").read_text())
  assert info["ema_decay"] is None
  rows = {r["variant"]: r for r in summary["ablation"]}
  assert list(rows) == ["full recipe", "no_ema"]
  assert rows["no_ema"]["flags"] == "--ema_decay=0"
  assert variant["reached"]
  delta = (variant["time_to_target_seconds"]
           - runs[0]["time_to_target_seconds"])
  assert rows["no_ema"]["delta"]["seconds"] == pytest.approx(delta)
  assert re.search(rf"^no_ema\s+--ema_decay=0\s+[\d.]+ s\s+[\d.]+ %\s+"
                   + re.escape(f"{delta:+.1f} s") + "$", out, re.M), out
  assert (results / "tiny_no_ema_seed0_seconds.png").exists()


@pytest.mark.slow
def test_an_unreachable_target_reports_the_best_accuracy(tmp_path):
  results = tmp_path / "results"
  # A learning rate too small to move the weights: the target is missed.
  proc = run_script(SCRIPT, f"--recipe={_recipe(tmp_path)}", "--seeds=3",
                    f"--work_dir={tmp_path / 'work'}",
                    f"--results_dir={results}",
                    "--extra=--stop_at_accuracy=0.99",
                    "--extra=--learning_rate=1e-9", "--nomeasure_peak",
                    timeout=600)
  out = proc.stdout
  assert "time to 99.00 % test accuracy" in out
  reached, time_to_target, launch, _, best, _, epochs = _row(out, "seed 3")
  assert (reached, time_to_target, launch) == ("no", "-", "-")
  figures = json.loads((results / "tiny_seed3.json").read_text())
  assert not figures["reached"] and figures["time_to_target_seconds"] is None
  # Trained to the end: evaluations at every 8 steps, one epoch.
  assert [e["step"] for e in figures["evaluations"]] == [8, 16, 24, 32]
  assert float(epochs) == figures["epochs_run"] == 1.0
  best_accuracy = max(e["accuracy"] for e in figures["evaluations"])
  assert figures["best_accuracy"] == best_accuracy < 0.99
  assert float(best) == pytest.approx(100 * best_accuracy, abs=0.005)
  assert re.search(
      rf"^median time to target: not reached \(0 of 1 seeds reached 99.00 "
      rf"%\); median best accuracy {100 * best_accuracy:.2f} %$", out, re.M)
  assert re.search(r"^goal:\s+median time to target <= 300 s: not met$", out,
                   re.M)
  summary = json.loads((results / "tiny_summary.json").read_text())
  assert summary["median_time_to_target_seconds"] is None
  assert summary["median_best_accuracy"] == best_accuracy
  assert not summary["goal_met"] and not summary["milestone_met"]


@pytest.mark.parametrize("args, fragment", [
    (["--seeds=0,x"], "seeds=0,x"),
    (["--seeds=1,1"], "distinct"),
    (["--ablate=no_such"], "unknown variant 'no_such'"),
    (["--ablate=odd name:--epochs=1"], "variant name 'odd name'"),
    (["--ablate=v:"], "no flags"),
    (["--ablate=no_ema", "--ablate=no_ema"], "'no_ema' given twice"),
    (["--extra=--seed=4"], "--seed is set by"),
    (["--extra=epochs=4"], "not a train.py flag"),
    (["--recipe=/no/such.cfg"], "recipe=/no/such.cfg"),
    (["--notarget"], "sets no --stop_at_accuracy"),
    (["--existing"], "exists"),
])
def test_bad_input_is_one_line_and_runs_nothing(tmp_path, args, fragment):
  recipe = _recipe(tmp_path)
  if "--notarget" in args:
    recipe = _recipe(tmp_path, [l for l in TINY if "stop_at" not in l])
  work = tmp_path / "work"
  if "--existing" in args:
    (work / "seed_0").mkdir(parents=True)
    (work / "seed_0" / "checkpoint").write_text("kept")
  args = [a for a in args if a not in ("--notarget", "--existing")]
  before = snapshot(tmp_path)
  proc = run_script(SCRIPT, f"--recipe={recipe}", f"--work_dir={work}",
                    f"--results_dir={tmp_path / 'results'}", *args,
                    check=False, timeout=120)
  assert_one_line_error(proc, "time_to_accuracy.py", fragment,
                        unchanged=before)


def test_a_failed_matmul_peak_measurement_is_one_clear_error():
  # In a process of its own: the benchmark's flags clash with train.py's.
  code = (
      "import sys; sys.path.insert(0, '.');"
      "from scripts.benchmarks import time_to_accuracy as t;"
      "sys.executable = '/bin/false'\n"
      "try:\n  t.matmul_peak_gflops(2048)\n"
      "except Exception as e:\n  print(type(e).__name__ + ': ' + str(e))\n")
  proc = subprocess.run([sys.executable, "-c", code], cwd=helpers.ROOT,
                        capture_output=True, text=True, timeout=120,
                        check=False)
  assert ("ConfigError: measuring the matmul peak failed (exit 1: no "
          "output); --nomeasure_peak skips it") in proc.stdout, (
              proc.stdout + proc.stderr[-2000:])


def test_the_reported_dtype_follows_the_command_then_the_flag_file(tmp_path):
  from scripts.benchmarks import tta_report  # pylint: disable=g-import-not-at-top
  recipe = _recipe(tmp_path, ["# --mixed_precision=float16 (a comment)",
                              *TINY, "--mixed_precision=bfloat16"])
  value = lambda *args: tta_report.flag_value(["train.py", *args],
                                              "mixed_precision")
  assert value(f"--flagfile={recipe}") == "bfloat16"
  assert value(f"--flagfile={recipe}", "--mixed_precision=float32") == (
      "float32")
  assert value("--mixed_precision=float32", f"--flagfile={recipe}") == (
      "bfloat16")
  assert value(f"--flagfile={_recipe(tmp_path)}") is None
