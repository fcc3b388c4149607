"""Each worker's step time, split into compute and all-reduce wait, in
TensorBoard and metrics.jsonl; the chief names a worker slower than the
median by more than --straggler_factor."""

import glob
import os
import subprocess

import pytest
import tensorflow as tf

import cluster_utils as cu
import helpers
import zygote_client
from framework.core import summaries

# train.py whose worker 1 sleeps 0.5 s in every step's forward/backward
# (before the all-reduce): the slow worker of the cluster.
SLOW_WORKER_1 = """
import json, os, sys, time
sys.path.insert(0, {root!r})
import tensorflow as tf
from absl import app
from framework.core.trainer import Trainer
from scripts import cli, train

SLOW = json.loads(os.environ["TF_CONFIG"])["task"]["index"] == 1

class SlowOnWorker1(Trainer):
  def compute_gradients(self, batch):
    grads, metrics = super().compute_gradients(batch)
    if not SLOW:
      return grads, metrics
    slept = tf.numpy_function(lambda: time.sleep(0.5) or 0.0, [], tf.float64)
    with tf.control_dependencies([slept]):
      return [tf.identity(g) for g in grads], metrics

app.run(cli.main_running(lambda: train.run_main(SlowOnWorker1)))
"""


@pytest.mark.slow
def test_the_chief_names_the_slow_worker_and_writes_each_workers_times(
    tmp_path):
  script = tmp_path / "slow_train.py"
  script.write_text(SLOW_WORKER_1.format(root=cu.ROOT))
  model_dir = tmp_path / "run"
  proc = subprocess.run(
      cu.LAUNCH + ["--workers=2", "--grace_period=5", "--",
                   zygote_client.python(), str(script)] + cu.MLP + [
                       "--strategy=multi_worker_mirrored", "--train_steps=15",
                       f"--model_dir={model_dir}"],
      cwd=cu.ROOT, env=cu.ENV, capture_output=True, text=True, timeout=600)
  output = proc.stdout + proc.stderr
  assert proc.returncode == 0, output[-3000:]
  lines = [l for l in output.splitlines() if "straggler at step" in l]
  # The chief (worker 0) logs it; the loops after the first (which traces)
  # name worker 1 and only it.
  later = [l for l in lines if "at step 10:" in l or "at step 15:" in l]
  assert len(later) == 2, output[-3000:]
  for line in later:
    assert "[worker:0]" in line and ": worker:1 " in line, line
    assert "worker:0 " not in line.split("straggler at step")[1], line
  # Every worker's compute and wait per step, at every summary step.
  names = {f"step_time/worker_{i}/{part}" for i in (0, 1)
           for part in ("compute", "wait")}
  points = summaries.read_metrics(str(model_dir / "metrics.jsonl"))
  by_step = {}
  for p in points:
    if p["name"].startswith("step_time/"):
      by_step.setdefault(p["step"], {})[p["name"]] = p["value"]
  assert sorted(by_step) == [5, 10, 15], sorted(by_step)
  assert set(by_step[10]) == names
  # Worker 1 computes (sleeps) and worker 0 waits for it in the all-reduce.
  assert by_step[10]["step_time/worker_1/compute"] > 0.45, by_step
  assert by_step[10]["step_time/worker_0/wait"] > 0.3, by_step
  assert by_step[10]["step_time/worker_1/wait"] < (
      by_step[10]["step_time/worker_0/wait"]), by_step
  tags = set()
  for path in glob.glob(str(model_dir / "train" / "events.out.tfevents.*")):
    for event in tf.compat.v1.train.summary_iterator(path):
      tags.update(v.tag for v in event.summary.value)
  assert names <= tags, sorted(tags)


@pytest.mark.parametrize("value", ["1", "0.5", "-2", "nan"])
def test_a_bad_straggler_factor_is_one_line_before_anything_is_built(
    tmp_path, value):
  model_dir = tmp_path / "run"
  proc = helpers.run_script(
      "train.py", *cu.MLP, "--train_steps=2", f"--model_dir={model_dir}",
      f"--straggler_factor={value}", check=False)
  assert proc.returncode == 1, proc.stderr[-2000:]
  [line] = cu.error_lines(proc.stderr)
  assert line.startswith(f"train.py: error: straggler_factor={float(value)}"
                         " must be a number > 1"), line
  assert not model_dir.exists()
