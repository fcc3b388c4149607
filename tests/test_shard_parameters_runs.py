"""`train.py --shard_parameters` (ZeRO-3) end to end: 2 MWMS worker
processes end with the unsharded run's weights and slots (AdamW with
accumulation); a run resumes with it on after an unsharded start
and off after a sharded one, on other replica counts; a worker killed with
kill -9 and the cluster relaunched ends as never interrupted; bad
combination is one line before anything is built."""

import pytest

from tests import cluster_utils as cu

STEPS = 6
# A size of its own (13 hidden units: odd, so halves are padded).
MLP = cu.MLP + ["--hidden_units=13", "--checkpoint_every=3",
                "--clip_norm=0.5", "--steps_per_loop=2"]
ZERO3 = ["--shard_optimizer_state", "--shard_gradients", "--shard_parameters"]


def _train(model_dir, *flags, base=MLP):
  proc = cu.run_train(base + [f"--model_dir={model_dir}", *flags],
                      timeout=900)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc


def _launch(model_dir, *flags):
  proc = cu.launch(MLP + ["--strategy=multi_worker_mirrored",
                          f"--model_dir={model_dir}", *flags])
  assert proc.returncode == 0, proc.stdout[-4000:]
  return proc


@pytest.mark.slow
def test_two_workers_sharded_parameters_equal_unsharded(tmp_path):
  # AdamW with accumulation: the update, decay and micro-batch paths
  # (momentum and Adam on 2 replicas: tests/test_shard_parameters.py).
  optimizer = "adamw"
  flags = [f"--optimizer={optimizer}", f"--train_steps={STEPS}",
           "--grad_accum_steps=2"]
  plain, sharded = str(tmp_path / "plain"), str(tmp_path / "zero3")
  _launch(plain, *flags)
  _launch(sharded, *flags, *ZERO3)
  assert cu.global_step(sharded) == STEPS
  # Weights and every slot (checkpoints hold whole tensors, same keys).
  difference = cu.max_weight_difference(plain, sharded)
  print(f"{optimizer}: 2 workers ZeRO-3 vs unsharded: max |diff| "
        f"{difference:.3g}")
  assert difference <= 1e-5


@pytest.mark.slow
def test_resumes_with_it_toggled_and_on_another_replica_count(tmp_path):
  reference = str(tmp_path / "reference")
  _train(reference, "--strategy=mirrored", "--cpu_devices=2",
         f"--train_steps={2 * STEPS}")
  # ZeRO-3 over 2 replicas, then unsharded on one device.
  on_off = str(tmp_path / "on_then_off")
  _train(on_off, "--strategy=mirrored", "--cpu_devices=2", *ZERO3,
         f"--train_steps={STEPS}")
  proc = _train(on_off, "--strategy=one_device", f"--train_steps={2 * STEPS}")
  assert f"Restored checkpoint {on_off}/ckpt-{STEPS}" in proc.stderr
  # Unsharded over 2 replicas, then ZeRO-3 over 4.
  off_on = str(tmp_path / "off_then_on")
  _train(off_on, "--strategy=mirrored", "--cpu_devices=2",
         f"--train_steps={STEPS}")
  proc = _train(off_on, "--strategy=mirrored", "--cpu_devices=4", *ZERO3,
                f"--train_steps={2 * STEPS}")
  assert f"Restored checkpoint {off_on}/ckpt-{STEPS}" in proc.stderr
  for resumed in (on_off, off_on):
    assert cu.global_step(resumed) == 2 * STEPS
    # Another replica count sums in another order: float32 round-off only.
    difference = cu.max_weight_difference(reference, resumed)
    print(f"{resumed}: max |diff| {difference:.3g}")
    assert difference <= 1e-5


@pytest.mark.slow
def test_kill_9_and_relaunch_equals_uninterrupted(tmp_path):
  difference, _ = cu.kill_9_and_relaunch(tmp_path, MLP + ZERO3,
                                         steps=3 * STEPS, min_step=3)
  assert difference <= 1e-6


@pytest.mark.slow
def test_a_bad_combination_is_one_line_and_builds_nothing(tmp_path):
  # Every refusal, in process: tests/test_shard_parameters.py.
  model_dir = tmp_path / "run"
  proc = cu.run_train(MLP + [f"--model_dir={model_dir}", "--train_steps=2",
                             *ZERO3, "--strategy=parameter_server"],
                      timeout=300)
  assert proc.returncode != 0
  lines = cu.error_lines(proc.stderr)
  assert len(lines) == 1 and "parameter_server" in lines[0], proc.stderr[-2000:]
  assert lines[0].startswith("train.py: error: ")
  assert not model_dir.exists()
