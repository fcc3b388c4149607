"""scripts/benchmark.py runs end to end and reports what issue 6 asks for.

Only the structure and the counted FLOPs are checked: timings are measured by
the benchmark, never asserted in tests.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_quick_benchmark_reports_ratios_mfu_and_breakdown(tmp_path):
  output = tmp_path / "bench.json"
  proc = subprocess.run(
      [sys.executable, os.path.join(ROOT, "scripts", "benchmark.py"),
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
