"""spike_policy=skip: a step whose loss or gradient norm spikes above the
running median changes nothing (weights, slots, iterations), is counted,
and the run ends bit for bit as one that never saw that batch; bad
settings are one ConfigError; the window survives a checkpoint."""

import json

import numpy as np
import pytest
import tensorflow as tf

import framework
from framework.errors import ConfigError
import helpers
from test_trainer import GLOBAL_BATCH, make_trainer

STEPS = 10
SPIKE = 6  # the 0-based batch made to spike (after the window is full)


def _batches(spike=SPIKE, steps=STEPS):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(steps, GLOBAL_BATCH, 4, 4, 3)).astype(np.float32)
  y = rng.integers(0, 10, size=(steps, GLOBAL_BATCH)).astype(np.int32)
  if spike is not None:
    x[spike] *= 1e4
  return x, y


def _iterator(trainer, x, y, drop=None):
  keep = [i for i in range(len(x)) if i != drop]
  data = tf.data.Dataset.from_tensor_slices((x[keep], y[keep])).unbatch()
  data = data.batch(GLOBAL_BATCH, drop_remainder=True)
  return iter(trainer.strategy.experimental_distribute_dataset(data))


def _state(trainer):
  return [v.numpy() for v in trainer.model.variables] + [
      v.numpy() for v in trainer.optimizer.variables]


@pytest.mark.parametrize("strategy,options", [
    ("one_device", {}),
    ("mirrored", {}),
    ("mirrored", {"shard_optimizer_state": True}),
    ("mirrored", {"grad_accum_steps": 2}),
])
def test_skip_equals_a_run_that_never_saw_the_batch(strategy, options):
  x, y = _batches()
  spiked = make_trainer(strategy, optimizer="adam", learning_rate=1e-3,
                        spike_policy="skip", spike_factor=5, spike_window=3,
                        **options)
  spiked.train(_iterator(spiked, x, y), STEPS)
  clean = make_trainer(strategy, optimizer="adam", learning_rate=1e-3,
                       **options)
  clean.train(_iterator(clean, x, y, drop=SPIKE), STEPS - 1)
  assert int(spiked.spikes.skipped.numpy()) == 1
  assert int(spiked.global_step.numpy()) == STEPS
  assert int(spiked.optimizer.iterations.numpy()) == STEPS - 1
  for a, b in zip(_state(spiked), _state(clean)):
    np.testing.assert_array_equal(a, b)


def test_no_spike_is_decided_before_the_window_is_full():
  x, y = _batches(spike=2)  # step 3, the window holds 2 steps
  trainer = make_trainer("one_device", spike_policy="skip", spike_factor=5,
                         spike_window=3)
  trainer.train(_iterator(trainer, x, y), 3)
  assert int(trainer.spikes.skipped.numpy()) == 0
  assert int(trainer.optimizer.iterations.numpy()) == 3
  assert int(trainer.spikes.seen.numpy()) == 3


def test_the_window_is_checkpointed_and_decides_after_a_restore(tmp_path):
  x, y = _batches()
  first = make_trainer("one_device", spike_policy="skip", spike_factor=5,
                       spike_window=3)
  first.train(_iterator(first, x, y), 4)
  checkpoint = tf.train.Checkpoint(window=first.spikes)
  path = checkpoint.save(str(tmp_path / "ckpt"))
  resumed = make_trainer("one_device", spike_policy="skip", spike_factor=5,
                         spike_window=3)
  tf.train.Checkpoint(window=resumed.spikes).restore(path)
  assert int(resumed.spikes.seen.numpy()) == 4
  # The window is full at once: the spiking batch is the first one it sees.
  resumed.train(_iterator(resumed, x[SPIKE:SPIKE + 1], y[SPIKE:SPIKE + 1]), 1)
  assert int(resumed.spikes.skipped.numpy()) == 1
  assert int(resumed.optimizer.iterations.numpy()) == 0


def test_spike_policy_none_adds_no_state():
  trainer = make_trainer("one_device")
  assert trainer.spikes is None


@pytest.mark.parametrize("options,named", [
    ({"spike_policy": "sometimes"}, "spike_policy"),
    ({"spike_policy": "skip", "spike_factor": 1.0}, "spike_factor=1.0"),
    ({"spike_policy": "skip", "spike_factor": 0.5}, "spike_factor=0.5"),
    ({"spike_policy": "skip", "spike_window": 0}, "spike_window=0"),
    ({"spike_policy": "skip", "spike_window": 2}, "spike_window=2"),
    # A window no memory holds was an OOM traceback in the first step.
    ({"spike_policy": "skip", "spike_window": 10**12},
     "spike_window=1000000000000"),
    # An infinite factor decides no spike: a policy silently off.
    ({"spike_policy": "skip", "spike_factor": float("inf")},
     "spike_factor=inf"),
])
def test_bad_spike_settings_are_one_config_error(options, named):
  with pytest.raises(ConfigError, match=named):
    make_trainer("one_device", **options)


# rollback, through the Controller: batches of a custom train_input.
ROLL_STEPS, ROLL_SPIKE, EVERY = 12, 6, 4  # spike at step 7: back to step 4


def _controller(model_dir, train_steps, **options):
  trainer = make_trainer("one_device", optimizer="adam", learning_rate=1e-3,
                         **options)
  x, y = _batches(steps=ROLL_STEPS + 8)

  def train_input(start):
    return tf.data.Dataset.from_tensor_slices((x[start:], y[start:]))

  config = framework.LoopConfig(train_steps=train_steps, steps_per_loop=4,
                                checkpoint_every=EVERY)
  controller = framework.Controller(
      trainer, config, str(model_dir), train_input=train_input,
      checkpoint_items=framework.core.checkpoints.checkpoint_items(trainer))
  controller.run()
  return trainer


def _written(model_dir, batches):
  model_dir.mkdir()
  (model_dir / "spike_batches.json").write_text(json.dumps({"rollbacks": [
      {"spike_step": 0, "checkpoint_step": 0, "batches": batches}]}))


def test_rollback_equals_a_run_that_never_saw_the_window(tmp_path):
  rolled = _controller(tmp_path / "rolled", ROLL_STEPS,
                       spike_policy="rollback", spike_factor=5,
                       spike_window=3)
  record = json.loads((tmp_path / "rolled" / "spike_batches.json").read_text())
  assert record["rollbacks"] == [{"spike_step": ROLL_SPIKE + 1,
                                  "checkpoint_step": EVERY,
                                  "batches": [4, 5, 6]}]
  _written(tmp_path / "clean", [4, 5, 6])
  clean = _controller(tmp_path / "clean", ROLL_STEPS)
  assert int(rolled.global_step.numpy()) == ROLL_STEPS
  for a, b in zip(_state(rolled), _state(clean)):
    np.testing.assert_array_equal(a, b)
  metrics = [json.loads(line) for line in
             (tmp_path / "rolled" / "metrics.jsonl").read_text().splitlines()]
  rolled_back = [m["value"] for m in metrics
                 if m.get("name") == "spikes/rolled_back"]
  assert rolled_back and rolled_back[-1] == 3.0
  # A relaunch with more steps skips the recorded batches too.
  more = _controller(tmp_path / "rolled", ROLL_STEPS + 4,
                     spike_policy="rollback", spike_factor=5, spike_window=3)
  clean_more = _controller(tmp_path / "clean", ROLL_STEPS + 4)
  for a, b in zip(_state(more), _state(clean_more)):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("flags,named", [
    (["--spike_policy=skip", "--spike_factor=1"], "spike_factor=1.0"),
    (["--spike_policy=skip", "--spike_window=2"], "spike_window=2"),
    (["--spike_policy=rollback", "--checkpoint_every=0"],
     "spike_policy=rollback needs checkpoints"),
])
def test_train_py_bad_spike_flags_are_one_line(tmp_path, flags, named):
  model_dir = tmp_path / "run"
  proc = helpers.run_script(
      "train.py", "--model=mlp", "--dataset=synthetic", "--train_steps=2",
      f"--model_dir={model_dir}", *flags, check=False)
  assert proc.returncode != 0
  errors = [l for l in proc.stderr.splitlines() if "error:" in l]
  assert len(errors) == 1 and named in errors[0], proc.stderr[-2000:]
  assert not model_dir.exists()
