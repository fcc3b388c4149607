"""scripts/benchmarks/ run end to end and report what issue 6 asks for.

Only the structure and the counted FLOPs are checked: timings are measured by
the benchmarks, never asserted in tests.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


BENCHMARKS = ("suite", "fit_vs_trainer", "variants", "breakdown",
              "multi_worker", "model_parallel")


def run(script, *args, timeout=120):
  return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", script),
                         *args], cwd=ROOT, capture_output=True, text=True,
                        timeout=timeout)


@pytest.mark.parametrize("name", BENCHMARKS)
def test_every_benchmark_parses_its_flags(name):
  # absl exits 1 after --helpfull; an unknown or duplicate flag would fail
  # before the help is printed.
  proc = run(f"benchmarks/{name}.py", "--helpfull")
  assert f"scripts/benchmarks/{name}.py" in proc.stdout, proc.stderr[-3000:]
  assert "--global_batch_size" in proc.stdout


@pytest.mark.parametrize("old, new", [
    ("benchmark.py", "suite.py"),
    ("benchmark_multi_worker.py", "multi_worker.py"),
    ("benchmark_model_parallel.py", "model_parallel.py")])
def test_old_benchmark_paths_forward_to_the_new_ones(old, new):
  proc = run(old, "--helpfull")
  # The new script's own help: its usage line names its new path.
  assert f"python scripts/benchmarks/{new}" in proc.stdout, proc.stderr
  assert f"scripts/benchmarks/{new}:" in proc.stdout


@pytest.mark.parametrize("role, new", [
    ("compare", "fit_vs_trainer"), ("breakdown", "breakdown"),
    ("variants_speed", "variants")])
def test_old_benchmark_roles_name_their_replacement(role, new):
  proc = run("benchmark.py", f"--role={role}", "--strategy=default")
  assert proc.returncode == 1
  assert proc.stdout == ""
  [line] = proc.stderr.splitlines()
  assert line.startswith(f"benchmark.py: error: --role={role} moved to "
                         f"scripts/benchmarks/{new}.py (python "), line


@pytest.mark.slow
def test_quick_benchmark_reports_ratios_mfu_and_breakdown(tmp_path):
  output = tmp_path / "bench.json"
  proc = subprocess.run(
      [sys.executable, os.path.join(ROOT, "scripts", "benchmarks", "suite.py"),
       "--quick", "--strategies=default", "--variants=float32,float32/accum2",
       "--global_batch_size=16", "--memory_batch_size=16",
       "--steps_per_loop=2", "--loops_per_round=1", "--rounds=2",
       f"--output_json={output}"],
      cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads(output.read_text())
  [compare] = result["compare"]
  assert compare["fit_steps_per_execution"] == 2  # same as steps_per_loop
  assert len(compare["ratios"]) == 2
  # FLOPs are counted in the graph and agree with the analytic count.
  assert compare["flops_per_example_graph"] == 143_259_648
  assert compare["flops_per_example_analytic"] == 143_259_648
  for key in ("fit_mfu", "trainer_mfu", "ratio_median", "matmul_peak_flops",
              "unfused_ratio_median"):
    assert compare[key] > 0, key
  # Both sides were profiled over the same steps; the Trainer applies
  # Adam with one fused kernel per variable, fit with Keras's op chain.
  trainer_ops = {row[0]: row[2] for row in compare["op_time"]["trainer"]["rows"]}
  fit_ops = {row[0]: row[2] for row in compare["op_time"]["fit"]["rows"]}
  assert trainer_ops["ResourceApplyAdam"] == 16 * 2  # 16 variables, 2 steps
  assert "ResourceApplyAdam" not in fit_ops
  assert [v["variant"] for v in result["variants"]] == [
      "float32", "float32/accum2"]
  assert all(v["train_rss_growth_mb"] is not None
             for v in result["variants"])
  breakdown = result["breakdown"]
  assert set(breakdown["ms_per_step"]) == {
      "input pipeline", "forward + loss", "+ backward", "full Trainer step"}
  assert breakdown["kernel_mfu"] > 0 and breakdown["loop_ceiling"] > 0
  # The layers timed alone are the model's conv/dense layers, and their
  # FLOPs add up to the counted training FLOPs of the batch.
  layers = breakdown["layers"]
  assert [row["layer"].split("_")[0] for row in layers] == [
      "conv2d"] * 4 + ["dense"] * 2
  assert sum(row["flops"] for row in layers) == 143_259_648 * 16
  assert breakdown["layer_kernels_mfu"] > 0
  op_names = [row[0] for row in breakdown["op_time"]["rows"]]
  assert any("Conv2D" in name for name in op_names), op_names
  for line in ("Keras fit (A) vs distloop Trainer (B", "where a step's time goes",
               "forward + backward kernels alone", "each timed alone",
               "op types of", "Trainer ms"):
    assert line in proc.stdout, proc.stdout
  assert set(result) == {"compare", "variants", "breakdown", "flags"}
