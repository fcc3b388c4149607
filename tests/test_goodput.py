"""Goodput: the run's wall time over its launches split into productive
steps and where the rest went, in goodput.json, the log, TensorBoard and
metrics.jsonl; steps redone after a relaunch and skipped steps are lost."""

import glob
import json
import time

import pytest
import tensorflow as tf

import cluster_utils as cu
import helpers
from framework.core import goodput, summaries

# train.py whose gradient is NaN at steps 5 and 6 (skipped under
# nan_policy=skip) and which kills itself (-9) inside step 15 when
# KILL_AT_STEP=14 is set.
SKIPS_AND_KILL = """
import os, signal, sys
sys.path.insert(0, {root!r})
import numpy as np
import tensorflow as tf
from absl import app
from framework.core.trainer import Trainer
from scripts import cli, train

KILL_AT = int(os.environ.get("KILL_AT_STEP", "-1"))

def kill_at(step):
  if step == KILL_AT:
    os.kill(os.getpid(), signal.SIGKILL)
  return step

class SkipsAndKill(Trainer):
  def compute_gradients(self, batch):
    grads, metrics = super().compute_gradients(batch)
    bad = tf.logical_and(self.global_step >= 4, self.global_step < 6)
    step = tf.numpy_function(kill_at, [self.global_step], tf.int64)
    with tf.control_dependencies([step]):
      return [g + tf.where(bad, np.nan, 0.0) for g in grads], metrics

app.run(cli.main_running(lambda: train.run_main(SkipsAndKill)))
"""


@pytest.mark.slow
def test_a_relaunch_adds_up_and_counts_the_redone_steps_as_lost(tmp_path):
  script = tmp_path / "skips_and_kill.py"
  script.write_text(SKIPS_AND_KILL.format(root=cu.ROOT))
  model_dir = tmp_path / "run"
  args = [*cu.MLP, "--train_steps=20", "--steps_per_loop=2",
          "--log_every=2", "--summary_every=2", "--checkpoint_every=10",
          "--nan_policy=skip", f"--model_dir={model_dir}"]
  started = time.time()
  killed = helpers.run_script(str(script), *args, check=False,
                              env={"KILL_AT_STEP": "14"})
  assert killed.returncode in (-9, 137), killed.stderr[-2000:]
  done = helpers.run_script(str(script), *args, check=False)
  ended = time.time()
  assert done.returncode == 0, done.stderr[-2000:]
  record = json.loads((model_dir / goodput.GOODPUT_FILE).read_text())
  account = record["account"]
  parts = {k: v for k, v in account.items() if k != "wall"}
  # The parts add up to the wall time, which lies inside the two launches.
  assert sum(parts.values()) == pytest.approx(account["wall"], rel=1e-9)
  assert 0 < account["wall"] <= ended - started
  assert record["launches"] == 2
  assert min(parts.values()) >= 0, parts
  for part in ("productive", "startup", "restart", "checkpoint",
               "lost_steps", "skipped"):
    assert parts[part] > 0, (part, parts)
  # Steps 11..14 were trained after checkpoint 10, killed, trained again;
  # steps 5 and 6 were skipped.
  assert record["lost_step_counts"] == {"lost_steps": 4, "skipped": 2}
  assert record["pending"] == []
  # One line at the end, and goodput/* at the last step in TensorBoard and
  # metrics.jsonl.
  [line] = [l for l in done.stderr.splitlines() if "] goodput " in l]
  assert "over 2 launch(es)" in line and "lost_steps" in line, line
  assert "(4 steps)" in line and "(2 steps)" in line, line
  points = {p["name"]: p for p in summaries.read_metrics(
      str(model_dir / "metrics.jsonl")) if p["name"].startswith("goodput/")}
  assert points["goodput/fraction"]["step"] == 20
  assert points["goodput/fraction"]["value"] == pytest.approx(
      account["productive"] / account["wall"], rel=1e-3)
  assert points["goodput/lost_steps_steps"]["value"] == 4
  tags = set()
  for path in glob.glob(str(model_dir / "train" / "events.out.tfevents.*")):
    for event in tf.compat.v1.train.summary_iterator(path):
      tags.update(v.tag for v in event.summary.value)
  assert {"goodput/fraction", "goodput/lost_steps_seconds",
          "goodput/skipped_seconds"} <= tags, sorted(tags)


def test_the_account_moves_time_between_parts_and_keeps_the_sum(tmp_path):
  account = goodput.Goodput(str(tmp_path), start_time=100.0)
  account.training(110.0)
  account.loop(1, 2, 8.0)  # tracing: 2 steps at the next loop's pace
  account.loop(3, 4, 2.0)
  account.lost_steps(1, "skipped")  # one of steps 3..4
  account.saved(4)
  account.loop(5, 6, 2.0)
  account.loop(7, 8, 2.0)
  account.restored(5, "rolled_back")  # steps 6..8 trained again
  parts = account.account(now=130.0)
  assert parts["startup"] == 10.0 and parts["compilation"] == 6.0
  assert parts["skipped"] == 1.0 and parts["rolled_back"] == 3.0
  # Steps 1, 2, 3 (or 4) and 5 count.
  assert parts["productive"] == 4.0
  assert parts["other"] == pytest.approx(30.0 - 24.0)
  assert sum(v for k, v in parts.items() if k != "wall") == parts["wall"]
  assert account.steps == {"skipped": 1, "rolled_back": 3}
  # A relaunch reads the account back: the time between is restart.
  account.write(now=130.0)
  again = goodput.Goodput(str(tmp_path), start_time=135.0)
  assert again.launches == 2 and again.seconds["restart"] == 5.0


def test_a_garbled_account_is_a_warning_and_counts_from_this_launch(
    tmp_path):
  (tmp_path / goodput.GOODPUT_FILE).write_text("{not json")
  account = goodput.Goodput(str(tmp_path), start_time=1.0)
  assert account.launches == 1 and account.steps == {}


def test_an_account_that_cannot_be_written_is_a_warning_not_an_error(
    tmp_path):
  blocked = tmp_path / "a_file"
  blocked.write_text("")
  account = goodput.Goodput(str(blocked), start_time=1.0)  # folder a file
  account.loop(1, 2, 1.0)
  account.write()
  account.write()  # said once; training goes on
  assert account._unwritable  # pylint: disable=protected-access


def test_a_rollback_counts_its_restore_as_rolled_back(tmp_path, monkeypatch):
  """The restore and the new iterator of a rollback are its time, not
  `other`: a rollback made 3 s slower moves 3 s into `rolled_back`."""
  import test_spike_policy as sp  # pylint: disable=g-import-not-at-top
  from framework.core import controller as controller_lib  # pylint: disable=g-import-not-at-top
  roll_back = controller_lib.Controller._roll_back

  def slow_roll_back(self, spike_step):
    time.sleep(3)
    return roll_back(self, spike_step)

  monkeypatch.setattr(controller_lib.Controller, "_roll_back", slow_roll_back)
  sp._controller(tmp_path / "rolled", sp.ROLL_STEPS, spike_policy="rollback",
                 spike_factor=5, spike_window=3)
  record = json.loads((tmp_path / "rolled" / "goodput.json").read_text())
  account = record["account"]
  assert record["lost_step_counts"]["rolled_back"] == 3, record
  assert account["rolled_back"] >= 3.0, account
  assert account["other"] < 3.0, account
