"""spike_policy=rollback (and skip) on several replicas and processes:
mirrored on 2 devices in one process and multi_worker_mirrored on 2 local
processes end with the weights and slots of a run that never saw the
spiking window (or batch); spike_batches.json is written once, by the
chief, and a relaunch skips the same batches.

The batches are test_spike_policy's (batch 6 scaled by 1e4). The reference
runs train on the same batches with the window deleted from the data, in
one process on 2 replicas (mirrored). Against them the mirrored runs are
equal bit for bit; the 2-process runs to within float32 rounding (relative
1e-5, absolute 1e-7): the cluster's collective all-reduce and its per-worker input
pipelines are another reduction than the mirrored strategy's in one
process (seen: at most 2.3e-9 absolute, in Adam's moments after 12 steps),
while a batch trained on that should have been skipped (a 1e4-scaled
batch) moves the weights by orders of magnitude more. The two workers
agree with each other bit for bit.
"""

import json
import os
import subprocess
import textwrap

import numpy as np
import pytest
import tensorflow as tf

import cluster_utils as cu
import framework
import zygote_client
from test_spike_policy import _batches, _state
from test_trainer import make_trainer

STEPS, SPIKE, EVERY = 12, 6, 4  # the spike is step 7: back to step 4
WINDOW = [4, 5, 6]  # the batches of steps 5..7: skipped
MORE = STEPS + 4  # the relaunch's train_steps
SPIKE_FLAGS = dict(spike_factor=5, spike_window=3)
# 2 processes against 1 (the module's docstring): (rtol, atol); the atol
# for slot entries near 0 (seen: 2.3e-9).
ROUNDING = (1e-5, 1e-7)


def train_input_of(x, y):
  def train_input(start):
    return tf.data.Dataset.from_tensor_slices((x[start:], y[start:]))
  return train_input


def run(strategy, model_dir, train_steps, drop=(), **options):
  """A Controller run of the batches (those of `drop` deleted); the
  trainer."""
  trainer = make_trainer(strategy, optimizer="adam", learning_rate=1e-3,
                         **options)
  x, y = _batches(steps=MORE + 8)
  keep = [i for i in range(len(x)) if i not in drop]
  config = framework.LoopConfig(train_steps=train_steps, steps_per_loop=4,
                                checkpoint_every=EVERY, keep_checkpoints=10)
  framework.Controller(
      trainer, config, str(model_dir), train_input=train_input_of(
          x[keep], y[keep]),
      checkpoint_items=framework.core.checkpoints.checkpoint_items(
          trainer)).run()
  return trainer


def checkpoint_state(path):
  """{name: array} of the weights and optimizer slots in checkpoint
  `path` (as cluster_utils.model_weights)."""
  reader = tf.train.load_checkpoint(path)
  return {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map()
          if k.startswith(("optimizer/_trainable_variables/",
                           "optimizer/_variables/"))}


def assert_same_checkpoints(a, b, rounding=(0.0, 0.0)):
  """Equal weights and slots (`rounding`: (rtol, atol) of float32
  rounding)."""
  a, b = checkpoint_state(a), checkpoint_state(b)
  assert a and a.keys() == b.keys()
  rtol, atol = rounding
  for k in a:
    np.testing.assert_allclose(a[k], b[k], rtol=rtol, atol=atol, err_msg=k)


def rollbacks(model_dir):
  return json.loads((model_dir / "spike_batches.json").read_text())[
      "rollbacks"]


def records_under(model_dir):
  return [os.path.join(root, f) for root, _, files in os.walk(model_dir)
          for f in files if f == "spike_batches.json"]


EXPECTED = [{"spike_step": SPIKE + 1, "checkpoint_step": EVERY,
             "batches": WINDOW}]


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
  """Mirrored runs on 2 devices that never saw the window (to MORE steps,
  checkpoints kept) or the spiking batch (to STEPS)."""
  folder = tmp_path_factory.mktemp("clean")
  run("mirrored", folder / "window", MORE, drop=WINDOW)
  run("mirrored", folder / "batch", STEPS - 1, drop=[SPIKE])
  return folder


def test_mirrored_rollback_equals_a_run_that_never_saw_the_window(
    tmp_path, clean):
  rolled = tmp_path / "rolled"
  trainer = run("mirrored", rolled, STEPS, spike_policy="rollback",
                **SPIKE_FLAGS)
  assert trainer.strategy.num_replicas_in_sync == 2
  assert rollbacks(rolled) == EXPECTED
  assert int(trainer.global_step.numpy()) == STEPS
  assert_same_checkpoints(str(rolled / f"ckpt-{STEPS}"),
                          str(clean / "window" / f"ckpt-{STEPS}"))
  # A relaunch with more steps skips the recorded batches too.
  run("mirrored", rolled, MORE, spike_policy="rollback", **SPIKE_FLAGS)
  assert rollbacks(rolled) == EXPECTED
  assert_same_checkpoints(str(rolled / f"ckpt-{MORE}"),
                          str(clean / "window" / f"ckpt-{MORE}"))


# One task of a multi_worker_mirrored cluster: `run` above, its trainer's
# state saved per task.
TASK = textwrap.dedent("""
    import json, os, sys
    sys.path[:0] = [{tests!r}, {root!r}]
    import numpy as np
    import test_spike_rollback_distributed as t

    model_dir, steps, policy, out = sys.argv[1:5]
    options = {{}} if policy == "none" else dict(spike_policy=policy,
                                               **t.SPIKE_FLAGS)
    trainer = t.run("multi_worker_mirrored", model_dir, int(steps), **options)
    assert trainer.strategy.num_replicas_in_sync == 2
    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    np.savez(os.path.join(out, f"{{policy}}_{{steps}}_{{task}}.npz"),
             *t._state(trainer))
""")


def launch(tmp_path, model_dir, steps, policy):
  """The task script on 2 workers; the launcher's output."""
  script = tmp_path / "task.py"
  script.write_text(TASK.format(tests=os.path.dirname(__file__),
                                root=cu.ROOT))
  proc = subprocess.run(
      cu.LAUNCH + ["--workers=2", "--grace_period=5", "--",
                   zygote_client.python(), str(script), str(model_dir),
                   str(steps), policy, str(tmp_path)],
      cwd=cu.ROOT, env=cu.ENV, capture_output=True, text=True, timeout=600)
  output = proc.stdout + proc.stderr
  assert proc.returncode == 0, output[-5000:]
  states = [np.load(tmp_path / f"{policy}_{steps}_{task}.npz")
            for task in (0, 1)]
  for a, b in zip(*(list(s.values()) for s in states)):
    np.testing.assert_array_equal(a, b)  # the workers agree
  return output


@pytest.mark.slow
def test_multi_worker_rollback_equals_a_run_that_never_saw_the_window(
    tmp_path, clean):
  rolled = tmp_path / "rolled"
  output = launch(tmp_path, rolled, STEPS, "rollback")
  # Each worker rolled back once, to the same checkpoint.
  for task in ("worker:0", "worker:1"):
    lines = [l for l in output.splitlines() if "loss spike at step" in l
             and f"[{task}]" in l]
    assert len(lines) == 1 and "rolled back to" in lines[0] and (
        f"(step {EVERY}); batches 4..6 skipped" in lines[0]), output[-5000:]
  # The chief's record, the only one.
  assert records_under(rolled) == [str(rolled / "spike_batches.json")]
  assert rollbacks(rolled) == EXPECTED
  assert_same_checkpoints(str(rolled / f"ckpt-{STEPS}"),
                          str(clean / "window" / f"ckpt-{STEPS}"), ROUNDING)
  # The relaunch: both workers skip the recorded batches, no new rollback.
  output = launch(tmp_path, rolled, MORE, "rollback")
  assert "loss spike at step" not in output, output[-5000:]
  assert records_under(rolled) == [str(rolled / "spike_batches.json")]
  assert rollbacks(rolled) == EXPECTED
  assert_same_checkpoints(str(rolled / f"ckpt-{MORE}"),
                          str(clean / "window" / f"ckpt-{MORE}"), ROUNDING)


@pytest.mark.slow
def test_multi_worker_skip_equals_a_run_that_never_saw_the_batch(
    tmp_path, clean):
  skipped = tmp_path / "skipped"
  launch(tmp_path, skipped, STEPS, "skip")
  assert not records_under(skipped)
  reader = tf.train.load_checkpoint(str(skipped / f"ckpt-{STEPS}"))
  assert int(reader.get_tensor(
      "spike_window/skipped/.ATTRIBUTES/VARIABLE_VALUE")) == 1
  assert_same_checkpoints(str(skipped / f"ckpt-{STEPS}"),
                          str(clean / "batch" / f"ckpt-{STEPS - 1}"), ROUNDING)
