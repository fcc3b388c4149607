"""scripts/evaluate.py: one checkpoint under any strategy, and --watch."""

import os
import re
import subprocess
import sys

import numpy as np
import pytest

import framework
import framework.data.datasets  # noqa: F401  (the attribute chain below)
from framework.app import evaluation, export, experiment
from tests.helpers import ROOT, run_script, snapshot
from tests.shared_strategy import mirrored


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  """An MLP trained 6 steps on 2 replicas on a tiny CIFAR-format set."""
  root = tmp_path_factory.mktemp("evaluate")
  data = framework.data.datasets.synthetic(num_train=64, num_test=21, seed=2)
  data_dir = str(root / "cifar")
  framework.data.datasets.write_cifar10(data_dir, data.train_x, data.train_y, data.test_x,
                          data.test_y)
  model_dir = str(root / "run")
  config = framework.ExperimentConfig(
      model="mlp", dataset="cifar10", data_dir=data_dir, model_dir=model_dir,
      strategy="mirrored", global_batch_size=16, train_steps=6,
      model_options={"hidden_units": (32,)}, export_saved_model=False,
      loop=framework.LoopConfig(train_steps=6, steps_per_loop=3,
                                checkpoint_every=3))
  experiment.run(config, strategy=mirrored())
  return dict(model_dir=model_dir, data=data)


def _expected(run, weights_path=None):
  """Loss, accuracy and confusion of the saved weights, in numpy."""
  info = export.read_model_info(run["model_dir"])
  model = export.build_inference_model(info)
  model.load_weights(weights_path or os.path.join(run["model_dir"],
                                                  export.WEIGHTS_FILE))
  data = run["data"]
  logits = model(data.test_x.astype(np.float32) / 255.0).numpy().astype(
      np.float64)
  log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  loss = -log_probs[np.arange(len(logits)), data.test_y].mean()
  predicted = logits.argmax(-1)
  confusion = np.zeros((10, 10), np.int64)
  np.add.at(confusion, (data.test_y, predicted), 1)
  return loss, (predicted == data.test_y).mean(), confusion


def _printed(stdout, name):
  return [float(v) for v in re.findall(rf"^\s+{name}\s+(\S+)$", stdout, re.M)]


def test_evaluate_latest_checkpoint_on_two_replicas(run_dir):
  proc = run_script("evaluate.py", f"--model_dir={run_dir['model_dir']}",
                    "--strategy=mirrored", "--cpu_devices=2",
                    "--global_batch_size=8")
  loss, accuracy, confusion = _expected(run_dir)
  assert "(step 6): 21 examples" in proc.stdout
  assert _printed(proc.stdout, "loss")[0] == pytest.approx(loss, abs=1e-5)
  assert _printed(proc.stdout, "accuracy")[0] == pytest.approx(accuracy,
                                                               abs=1e-6)
  rows = re.findall(r"^\s*\d+ (?:airplane|automobile|bird|cat|deer|dog|frog|"
                    r"horse|ship|truck)\s+([\d ]+)$", proc.stdout, re.M)
  np.testing.assert_array_equal([[int(v) for v in r.split()] for r in rows],
                                confusion)
  # Written to TensorBoard beside the run's own curves, never into them.
  assert [e.step for e in _tensors(run_dir, "eval_standalone",
                                   "confusion_matrix")] == [6]
  assert len(_tensors(run_dir, "eval", "accuracy")) == 1  # the run's own


def _tensors(run_dir, folder, tag):
  from tensorboard.backend.event_processing import event_accumulator  # pylint: disable=g-import-not-at-top
  acc = event_accumulator.EventAccumulator(
      os.path.join(run_dir["model_dir"], folder),
      size_guidance={event_accumulator.TENSORS: 0})
  acc.Reload()
  return acc.Tensors(tag) if tag in acc.Tags()["tensors"] else []


def _read_only(path):
  """Makes directory `path` unwritable (even by root: chattr +i); returns
  the undo, or None where this host cannot."""
  if subprocess.run(["chattr", "+i", path], capture_output=True,
                    check=False).returncode == 0:
    return lambda: subprocess.run(["chattr", "-i", path], check=True)
  if os.geteuid() != 0:
    os.chmod(path, 0o555)
    return lambda: os.chmod(path, 0o755)
  return None


def test_summaries_never_go_into_the_runs_own_eval(run_dir, tmp_path):
  model_dir = run_dir["model_dir"]
  with pytest.raises(framework.ConfigError, match="own evaluation curves"):
    evaluation.EvalConfig(model_dir=model_dir,
                          eval_dir=os.path.join(model_dir, "eval", ""))
  with pytest.raises(framework.ConfigError, match="eval_name='a/b'"):
    evaluation.EvalConfig(model_dir=model_dir, eval_name="a/b")
  assert evaluation.EvalConfig(
      model_dir=model_dir, eval_name="nightly").summary_dir == os.path.join(
          model_dir, "eval_nightly")
  # A read-only model dir: one line, exit 1, nothing written.
  undo = _read_only(model_dir)
  if undo is None:
    pytest.skip("cannot make a directory read-only for root here")
  before = snapshot(model_dir)
  try:
    # A folder of its own that does not exist yet, as on a fresh copy.
    proc = run_script("evaluate.py", f"--model_dir={model_dir}",
                      "--eval_name=read_only", check=False)
  finally:
    undo()
  assert proc.returncode == 1
  lines = [l for l in proc.stderr.splitlines() if "evaluate.py:" in l]
  assert len(lines) == 1 and "cannot write evaluation summaries" in lines[0]
  assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
  assert snapshot(model_dir) == before


def test_evaluate_given_checkpoint_and_bad_inputs(run_dir, tmp_path):
  first = os.path.join(run_dir["model_dir"], "ckpt-3")
  proc = run_script("evaluate.py", f"--model_dir={run_dir['model_dir']}",
                    f"--checkpoint={first}")
  assert f"checkpoint {first} (step 3)" in proc.stdout
  for args, message in [
      ([f"--model_dir={tmp_path}"], "has no model_info.json"),
      ([f"--model_dir={run_dir['model_dir']}",
        f"--checkpoint={run_dir['model_dir']}/ckpt-99"], "does not exist")]:
    proc = run_script("evaluate.py", *args, check=False)
    assert proc.returncode != 0
    lines = [l for l in proc.stderr.splitlines() if "evaluate.py:" in l]
    assert len(lines) == 1 and message in lines[0], proc.stderr[-2000:]


@pytest.mark.slow
def test_watch_evaluates_new_checkpoints_and_exits_with_the_run(tmp_path):
  model_dir = str(tmp_path / "run")
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
  # The evaluator starts first and waits for the run to appear.
  watcher = subprocess.Popen(
      [sys.executable, os.path.join(ROOT, "scripts", "evaluate.py"),
       f"--model_dir={model_dir}", "--watch", "--poll_seconds=0.2",
       "--timeout_seconds=300"],
      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
      text=True)
  try:
    run_script("train.py", "--model=mlp", "--dataset=synthetic",
               "--strategy=mirrored", "--cpu_devices=2", "--train_steps=60",
               "--steps_per_loop=10", "--checkpoint_every=20",
               "--keep_checkpoints=5", "--global_batch_size=32",
               "--noexport_saved_model",
               f"--model_dir={model_dir}")
    stdout, stderr = watcher.communicate(timeout=240)
  finally:
    if watcher.poll() is None:
      watcher.kill()
      watcher.communicate()
  assert watcher.returncode == 0, stderr[-2000:]
  steps = [int(s) for s in re.findall(r"\(step (\d+)\)", stdout)]
  assert steps and steps[-1] == 60
  assert steps == sorted(set(steps))
