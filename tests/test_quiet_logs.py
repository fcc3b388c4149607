"""A run shows its own lines; TensorFlow's come back when asked for."""

import glob
import os
import subprocess
import sys

from helpers import ROOT

RUN = ["--model=mlp", "--dataset=synthetic", "--hidden_units=16",
       "--global_batch_size=32", "--strategy=mirrored", "--cpu_devices=2",
       "--train_steps=20", "--log_every=10", "--export_saved_model=false"]
TF_NOISE = ("Reduce to", "Collective all_reduce", "cpu_feature_guard",
            "cudart_stub", "absl::InitializeLog", "Sharding callback") + (
                # The CUDA probe's error line, meaningless without a driver.
                () if glob.glob("/dev/nvidia*") else ("cuInit",))


def train(*args):
  """train.py under the scripts' own default (helpers.run_script sets
  TF_CPP_MIN_LOG_LEVEL=2)."""
  env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
  proc = subprocess.run(
      [sys.executable, os.path.join(ROOT, "scripts", "train.py"), *RUN,
       *args], cwd=ROOT, env=env, capture_output=True, text=True,
      timeout=600)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return proc


def test_mirrored_run_prints_its_own_lines_only(tmp_path):
  proc = train(f"--model_dir={tmp_path}")
  lines = proc.stderr.splitlines()
  assert not [l for l in lines if any(n in l for n in TF_NOISE)], proc.stderr
  for own in ("train step 10/20", "train step 20/20", "Saved checkpoint",
              "eval  step 20", "final eval"):
    assert any(own in l for l in lines), (own, proc.stderr)


def test_verbosity_brings_tensorflow_lines_back(tmp_path):
  proc = train(f"--model_dir={tmp_path}", "--verbosity=1")
  assert "Reduce to" in proc.stderr
  assert "train step 20/20" in proc.stderr


FAKE_STDERR = r"""
import os, sys
sys.path.insert(0, {root!r})
from scripts import cli
with cli.filtered_stderr({level}):
  os.write(2, b"WARNING: All log messages before absl::InitializeLog() is "
              b"called are written to STDERR\n"
              b"I0000 00:00:1796054826.357001    6137 cudart_stub.cc:31] info\n"
              b"continued info\n"
              b"W0000 00:00:1796054826.357001    6137 x.cc:2] warning\n"
              b"E0000 00:00:1796054828.351271    6137 y.cc:52] error\n"
              b"a line of the program\n")
  print("python line", file=sys.stderr)
print("after", file=sys.stderr)
"""


def filtered(level):
  return subprocess.run(
      [sys.executable, "-c", FAKE_STDERR.format(root=ROOT, level=level)],
      capture_output=True, text=True, timeout=60, check=True).stderr


def test_cpp_lines_below_the_level_are_dropped():
  out = filtered(2)
  assert "InitializeLog" not in out and "info" not in out
  assert "warning" not in out
  assert "y.cc:52] error" in out
  assert "a line of the program\npython line\nafter\n" in out


def test_level_0_keeps_every_line():
  out = filtered(0)
  for text in ("InitializeLog", "] info", "continued info", "] warning",
               "] error", "a line of the program", "python line", "after"):
    assert text in out


def test_tensorflow_import_leaves_the_collector_on_with_its_objects_frozen():
  code = ("import gc, sys; sys.path.insert(0, sys.argv[1]); "
          "from scripts import cli; cli.import_tensorflow_quietly(); "
          "print(gc.isenabled(), gc.get_freeze_count())")
  proc = subprocess.run([sys.executable, "-c", code, ROOT], cwd=ROOT,
                        capture_output=True, text=True, timeout=300)
  enabled, frozen = proc.stdout.split()
  assert enabled == "True"
  assert int(frozen) > 100_000  # TensorFlow's objects, out of the walks
