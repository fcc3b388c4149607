"""The guide's examples, copied to a folder outside the repository and run
there as a user runs them: a fresh interpreter, no PYTHONPATH, only the
installed packages (`framework`, `distloop_cli`)."""

import glob
import os
import re
import shutil
import subprocess
import sys

import pytest

from helpers import ROOT

# TensorFlow's own lines, which train.py hides (a user script too).
TF_NOISE = ("INFO:tensorflow", "Reduce to", "Collective all_reduce",
            "cudart_stub", "absl::InitializeLog") + (
                () if glob.glob("/dev/nvidia*") else ("cuInit",))


def guide_block(page, marker):
  """The fenced python block of docs/guide/<page> that contains `marker`."""
  with open(os.path.join(ROOT, "docs", "guide", page)) as f:
    text = f.read()
  blocks = re.findall(r"```python\n(.*?)```", text, re.S)
  found = [b for b in blocks if marker in b]
  assert len(found) == 1, f"{page}: {len(found)} python blocks with {marker!r}"
  return found[0]


def run(cwd, *args, timeout=600):
  env = dict(os.environ)
  for name in ("PYTHONPATH", "TF_CPP_MIN_LOG_LEVEL"):
    env.pop(name, None)
  return subprocess.run([sys.executable, *args], cwd=cwd, env=env,
                        capture_output=True, text=True, timeout=timeout)


def noise(stderr):
  return [l for l in stderr.splitlines() if any(n in l for n in TF_NOISE)]


@pytest.mark.slow
def test_own_model_example_trains_and_evaluates_from_its_folder(tmp_path):
  (tmp_path / "my_nets.py").write_text(guide_block(
      "own_model.md", "def build(input_shape, num_classes, hidden_units"))
  proc = run(tmp_path, os.path.join(ROOT, "scripts", "train.py"),
             "--model=my_nets:build", "--dataset=synthetic",
             "--train_steps=20", "--model_dir=runs/mine",
             "--export_saved_model=false")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert not noise(proc.stderr), noise(proc.stderr)
  proc = run(tmp_path, os.path.join(ROOT, "scripts", "evaluate.py"),
             "--model_dir=runs/mine", "--model=my_nets:build")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert re.search(r"^  accuracy\s+[\d.]+$", proc.stdout, re.M)


@pytest.mark.slow
def test_python_api_example_runs_as_it_is(tmp_path):
  (tmp_path / "mine.py").write_text(guide_block(
      "python_api.md", "controller = framework.Controller("))
  proc = run(tmp_path, "mine.py")
  assert proc.returncode == 0, proc.stderr[-3000:]
  # Its stop_when may end it before step 40.
  assert re.search(r"train step \d+/40: loss=", proc.stderr)
  assert re.search(r"'accuracy': [\d.]+", proc.stdout)


@pytest.mark.slow
def test_custom_step_example_copied_elsewhere_behaves_like_train_py(
    tmp_path):
  shutil.copy(os.path.join(ROOT, "scripts", "examples", "custom_step.py"),
              tmp_path)
  proc = run(tmp_path, "custom_step.py", "--model=mlp", "--hidden_units=16",
             "--dataset=synthetic", "--strategy=mirrored", "--cpu_devices=2",
             "--train_steps=10", "--log_every=5", "--gradient_penalty=0.01",
             "--export_saved_model=false", "--model_dir=runs/custom")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert not noise(proc.stderr), noise(proc.stderr)
  assert "train step 10/10" in proc.stderr and "final eval" in proc.stderr
  # Bad values: exit status 1 and train.py's lines (absl's for a value
  # that does not parse, one line of distloop's for a bad setting).
  for flag, expected in (
      ("--global_batch_size=0", "custom_step.py: error: global_batch_size"),
      ("--gradient_penalty=abc",
       "FATAL Flags parsing error: flag --gradient_penalty=abc")):
    proc = run(tmp_path, "custom_step.py", "--dataset=synthetic", flag,
               "--train_steps=2", "--model_dir=runs/bad")
    assert proc.returncode == 1, (flag, proc.stderr[-2000:])
    assert expected in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
  assert not os.path.exists(tmp_path / "runs" / "bad")


@pytest.mark.slow
def test_a_users_own_absl_script_gets_train_pys_logs_and_exit_codes(
    tmp_path):
  (tmp_path / "my_app.py").write_text(guide_block(
      "custom_step.md", "cli.run_app(main)"))
  proc = run(tmp_path, "my_app.py", "--train_steps=4")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert not noise(proc.stderr), noise(proc.stderr)
  assert "train step 4/4" in proc.stderr and "eval  step 4" in proc.stderr
  proc = run(tmp_path, "my_app.py", "--train_steps=-3")
  assert proc.returncode == 1, proc.stderr[-2000:]
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith("my_app.py: error: ") and "train_steps" in last
  assert "Traceback" not in proc.stderr
