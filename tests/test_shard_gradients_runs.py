"""`train.py --shard_gradients` (ZeRO-2) end to end: 2 MWMS worker
processes end with the unsharded run's weights and slots (with and without
--grad_accum_steps); a run resumes with it off on another replica count
and with it on after an unsharded start; a worker killed with kill -9 and
the cluster relaunched ends as never interrupted; bad combinations are one
line before anything is built."""

import re

import pytest

from tests import cluster_utils as cu

STEPS = 8
# A size of its own (11 hidden units: odd, so halves are padded).
MLP = cu.MLP + ["--hidden_units=11", "--checkpoint_every=4",
                "--clip_norm=0.5"]
ZERO2 = ["--shard_optimizer_state", "--shard_gradients"]


def _train(model_dir, *flags):
  proc = cu.run_train(MLP + [f"--model_dir={model_dir}", *flags], timeout=900)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc


def _launch(model_dir, *flags):
  proc = cu.launch(MLP + ["--strategy=multi_worker_mirrored",
                          f"--model_dir={model_dir}", *flags])
  assert proc.returncode == 0, proc.stdout[-4000:]
  return proc


def _gradient_bytes(output):
  """[(bytes a replica holds, the whole gradient's)] of each ZeRO-2 task's
  log line."""
  return [(int(a), int(b)) for a, b in re.findall(
      r"shard_gradients: each replica accumulates and updates with (\d+) of "
      r"the gradient's (\d+) bytes", output)]


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["momentum", "adam"])
def test_two_workers_sharded_gradients_equal_unsharded(tmp_path, optimizer):
  plain = str(tmp_path / "plain")
  _launch(plain, f"--optimizer={optimizer}", f"--train_steps={STEPS}")
  for accum in (1, 2):
    sharded = str(tmp_path / f"zero2_accum{accum}")
    proc = _launch(sharded, f"--optimizer={optimizer}",
                   f"--train_steps={STEPS}", f"--grad_accum_steps={accum}",
                   *ZERO2)
    assert cu.global_step(sharded) == STEPS
    # Both workers hold half of the gradient (one padding element: 11).
    held = _gradient_bytes(proc.stdout)
    assert len(held) == 2 and len(set(held)) == 1, proc.stdout[-3000:]
    assert held[0][0] == (held[0][1] + 4) // 2
    # Weights and every slot (checkpoints hold whole slots, same keys).
    difference = cu.max_weight_difference(plain, sharded)
    print(f"{optimizer}, grad_accum_steps={accum}: 2 workers ZeRO-2 vs "
          f"unsharded: max |diff| {difference:.3g}")
    assert difference <= 1e-6


@pytest.mark.slow
def test_resumes_with_it_toggled_and_on_another_replica_count(tmp_path):
  reference = str(tmp_path / "reference")
  _train(reference, "--strategy=mirrored", "--cpu_devices=2",
         "--grad_accum_steps=2", f"--train_steps={2 * STEPS}")
  # ZeRO-2 over 2 replicas, then unsharded over 4.
  on_off = str(tmp_path / "on_then_off")
  proc = _train(on_off, "--strategy=mirrored", "--cpu_devices=2",
                "--grad_accum_steps=2", *ZERO2, f"--train_steps={STEPS}")
  assert len(_gradient_bytes(proc.stderr)) == 1
  proc = _train(on_off, "--strategy=mirrored", "--cpu_devices=4",
                "--grad_accum_steps=2", f"--train_steps={2 * STEPS}")
  assert f"Restored checkpoint {on_off}/ckpt-{STEPS}" in proc.stderr
  # Unsharded on one device, then ZeRO-2 over 4 replicas.
  off_on = str(tmp_path / "off_then_on")
  _train(off_on, "--strategy=one_device", "--grad_accum_steps=2",
         f"--train_steps={STEPS}")
  proc = _train(off_on, "--strategy=mirrored", "--cpu_devices=4",
                "--grad_accum_steps=2", *ZERO2, f"--train_steps={2 * STEPS}")
  assert f"Restored checkpoint {off_on}/ckpt-{STEPS}" in proc.stderr
  [(held, whole)] = _gradient_bytes(proc.stderr)
  # 4 replicas: a quarter, each of the 4 variables padded by at most 3.
  assert whole <= held * 4 <= whole + 4 * 3 * 4
  for resumed in (on_off, off_on):
    assert cu.global_step(resumed) == 2 * STEPS
    # Another replica count sums in another order: float32 round-off only.
    difference = cu.max_weight_difference(reference, resumed)
    print(f"{resumed}: max |diff| {difference:.3g}")
    assert difference <= 1e-5


@pytest.mark.slow
def test_kill_9_and_relaunch_equals_uninterrupted(tmp_path):
  difference, uninterrupted = cu.kill_9_and_relaunch(
      tmp_path, MLP + ["--grad_accum_steps=2", *ZERO2], steps=3 * STEPS,
      min_step=4)
  assert len(_gradient_bytes(uninterrupted.stdout)) == 2
  assert difference <= 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("flags,named", [
    (["--shard_gradients"], "shard_optimizer_state"),
    (ZERO2 + ["--all_reduce_dtype=bfloat16"], "all_reduce_dtype=bfloat16"),
    (ZERO2 + ["--strategy=central_storage"], "central_storage"),
    (ZERO2 + ["--cpu_devices=2", "--model_parallel=tensor"],
     "model_parallel=tensor"),
])
def test_bad_combinations_are_one_line(tmp_path, flags, named):
  model_dir = tmp_path / "run"
  proc = cu.run_train(MLP + [f"--model_dir={model_dir}", "--train_steps=2",
                             *flags], timeout=300)
  assert proc.returncode != 0
  lines = cu.error_lines(proc.stderr)
  assert len(lines) == 1 and named in lines[0], proc.stderr[-2000:]
  assert lines[0].startswith("train.py: error: ")
  assert not model_dir.exists()
