"""`train.py --shard_optimizer_state` end to end: 2 MWMS worker processes
on 127.0.0.1 end with the unsharded run's weights and slots, and a sharded
run resumes on another replica count and unsharded on one device."""

import shutil

import pytest

from tests import cluster_utils as cu

STEPS = 10
MLP = cu.MLP + ["--checkpoint_every=5"]


def _train(model_dir, *flags):
  proc = cu.run_train(MLP + [f"--model_dir={model_dir}", *flags], timeout=900)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["momentum", "adam"])
def test_two_workers_sharded_equal_two_workers_unsharded(tmp_path, optimizer):
  dirs = {}
  for shard in (False, True):
    dirs[shard] = str(tmp_path / f"shard_{shard}")
    proc = cu.launch(MLP + [
        "--strategy=multi_worker_mirrored", f"--optimizer={optimizer}",
        f"--train_steps={STEPS}", f"--model_dir={dirs[shard]}",
        f"--shard_optimizer_state={str(shard).lower()}"])
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert cu.global_step(dirs[shard]) == STEPS
  # Weights and every slot (checkpoints hold whole slots, same keys).
  weights = cu.model_weights(dirs[True])
  assert sum(k.startswith("optimizer/_variables/") for k in weights) >= 4
  difference = cu.max_weight_difference(dirs[False], dirs[True])
  print(f"{optimizer}: 2 workers sharded vs unsharded: max |diff| "
        f"{difference:.3g}")
  assert difference <= 1e-6


@pytest.mark.slow
def test_sharded_run_resumes_on_four_replicas_and_on_one_device(tmp_path):
  reference = str(tmp_path / "reference")
  _train(reference, "--strategy=mirrored", "--cpu_devices=2",
         f"--train_steps={2 * STEPS}")
  # Half sharded over 2 replicas (one run, copied for both second halves),
  # the rest sharded over 4.
  half = str(tmp_path / "two")
  _train(half, "--strategy=mirrored", "--cpu_devices=2",
         "--shard_optimizer_state", f"--train_steps={STEPS}")
  resumed = str(tmp_path / "two_then_four")
  shutil.copytree(half, resumed)
  proc = _train(resumed, "--strategy=mirrored", "--cpu_devices=4",
                "--shard_optimizer_state", f"--train_steps={2 * STEPS}")
  assert f"Restored checkpoint {resumed}/ckpt-{STEPS}" in proc.stderr
  assert cu.global_step(resumed) == 2 * STEPS
  # Another replica count sums in another order: float32 round-off only.
  four = cu.max_weight_difference(reference, resumed)
  assert four <= 1e-5
  # Half sharded over 2 replicas, the rest unsharded on one device.
  single = str(tmp_path / "two_then_one")
  shutil.copytree(half, single)
  _train(single, "--strategy=one_device", f"--train_steps={2 * STEPS}")
  one = cu.max_weight_difference(reference, single)
  print(f"resumed on 4 replicas: max |diff| {four:.3g}; on one device: "
        f"{one:.3g}")
  assert one <= 1e-5


@pytest.mark.slow
def test_shard_optimizer_state_on_central_storage_is_one_line(tmp_path):
  model_dir = tmp_path / "run"
  proc = cu.run_train(MLP + [f"--model_dir={model_dir}", "--train_steps=2",
                             "--strategy=central_storage",
                             "--shard_optimizer_state"], timeout=300)
  assert proc.returncode != 0
  lines = cu.error_lines(proc.stderr)
  assert len(lines) == 1 and "shard_optimizer_state" in lines[0] and (
      "central_storage" in lines[0]), proc.stderr[-2000:]
  assert not model_dir.exists() or not any(model_dir.iterdir())
