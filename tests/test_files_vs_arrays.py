"""scripts/benchmarks/files_vs_arrays.py end to end on tiny CIFAR-shaped data.

Only what it reports is checked (both runs' accuracies at every evaluation,
the rates, the PNG); the figures themselves are measured, never asserted.
"""

import json
import re

import numpy as np
import pytest

import framework
import framework.data.datasets  # noqa: F401  (the attribute chain below)
from tests.helpers import run_script


@pytest.mark.slow
def test_files_vs_arrays_reports_both_curves(tmp_path):
  rng = np.random.default_rng(0)
  framework.data.datasets.write_cifar10(
      str(tmp_path / "src"), rng.integers(0, 256, (64, 32, 32, 3), np.uint8),
      rng.integers(0, 10, 64), rng.integers(0, 256, (20, 32, 32, 3), np.uint8),
      rng.integers(0, 10, 20))
  run_script("make_tfrecords.py", "--dataset=cifar10",
             f"--data_dir={tmp_path / 'src'}",
             f"--output_dir={tmp_path / 'tfr'}", "--num_shards=4")
  recipe = tmp_path / "tiny.cfg"
  recipe.write_text("\n".join([
      "--model=mlp", "--hidden_units=16", "--strategy=default",
      "--global_batch_size=16", "--optimizer=adam", "--steps_per_loop=2",
      "--eval_every=4", "--summary_every=2", "--log_every=2",
      "--checkpoint_every=0", ""]))
  work = tmp_path / "work"
  proc = run_script("benchmarks/files_vs_arrays.py",
                    f"--data_dir={tmp_path / 'src'}",
                    f"--tfrecord_dir={tmp_path / 'tfr'}",
                    f"--work_dir={work}", f"--recipe={recipe}", "--epochs=2")
  # 2 epochs of 64 examples in batches of 16: evaluations at steps 4 and 8.
  rows = re.findall(r"^\s+(\d+)\s+([\d.]+)%\s+([\d.]+)%\s+([+-][\d.]+)$",
                    proc.stdout, re.M)
  assert [int(r[0]) for r in rows] == [4, 8], proc.stdout
  for _, arrays, files, diff in rows:
    # --file_shuffle=global: the same batches, so the same accuracies.
    assert arrays == files and float(diff) == 0, proc.stdout
  assert re.search(r"final weights sha256: arrays (\w+), files \1: "
                   r"identical", proc.stdout), proc.stdout
  assert re.search(r"examples/s: arrays [\d,]+, files [\d,]+, files/arrays "
                   r"[\d.]+", proc.stdout), proc.stdout
  assert (work / "files_vs_arrays.png").stat().st_size > 1000
  for name, dataset in (("arrays", "cifar10"), ("files", "tfrecord")):
    info = json.loads((work / name / "model_info.json").read_text())
    assert info["dataset"] == dataset
    assert (work / name / "model.weights.h5").exists()
