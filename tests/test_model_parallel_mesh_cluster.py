"""`--mesh=data:2,model:2 --model_parallel_devices=cluster`: copy r of the
tensor split on worker task r's 2 devices (the tensor all-reduces inside
one process, the gradient all-reduce across the two), equal to the unsplit
GPT."""

import json
import os
import re
import signal
import subprocess
import time

import h5py
import numpy as np
import pytest

from framework.errors import ConfigError
from framework.model_parallel import config
from framework.model_parallel.config import parse_mesh
from tests import helpers
from tests.cluster_utils import ENV, LAUNCH, ROOT, train_command

# The tiny GPT of the in-process split tests on the byte-level text corpus
# (its vocabulary is the dataset's 256 bytes).
GPT = ["--model=gpt", "--dataset=text", "--global_batch_size=8",
       "--sequence_length=16", "--model_width=32", "--num_heads=4",
       "--num_layers=2", "--optimizer=momentum", "--momentum=0.9",
       "--learning_rate=0.1",
       "--steps_per_loop=1", "--log_every=1", "--summary_every=1",
       "--eval_steps=1", "--export_saved_model=false"]
STEPS = 5
CLUSTER = ["--mesh=data:2,model:2", "--model_parallel_devices=cluster",
           "--cpu_devices=2"]
TOLERANCE = 1e-5


def _names(tasks, cpus=2, gpus=0):
  names = ["/job:chief/replica:0/task:0/device:CPU:0"]
  for task in range(tasks):
    prefix = f"/job:worker/replica:0/task:{task}/device:"
    # Listed out of order: the groups are by device index.
    names += [f"{prefix}CPU:{i}" for i in reversed(range(cpus))]
    names += [f"{prefix}GPU:{i}" for i in range(gpus)]
  return names


def test_copy_r_is_on_worker_r_its_shards_on_that_tasks_devices():
  sizes = parse_mesh("data:2,model:2")
  assert config.worker_count(sizes) == 2
  assert config.devices_per_task(sizes) == 2
  assert config.cluster_groups("data:2,model:2", sizes, _names(2)) == [
      [f"/job:worker/replica:0/task:{r}/device:CPU:{d}" for d in range(2)]
      for r in range(2)]
  # A task with enough GPUs gives them; a third task is not used.
  groups = config.cluster_groups("data:2,model:2", sizes,
                                       _names(3, gpus=2))
  assert [g[1] for g in groups] == [
      "/job:worker/replica:0/task:0/device:GPU:1",
      "/job:worker/replica:0/task:1/device:GPU:1"]


def test_a_worker_with_too_few_devices_is_one_line():
  with pytest.raises(ConfigError) as error:
    config.cluster_groups("data:2,model:2",
                                parse_mesh("data:2,model:2"), _names(2, 1))
  message = str(error.value)
  assert "\n" not in message
  assert "worker 0 has 1 CPU device(s)" in message
  assert "--cpu_devices=2" in message


@pytest.mark.slow
def test_too_few_worker_tasks_for_the_data_axis_is_one_line(tmp_path):
  tf_config = {"cluster": {"chief": ["127.0.0.1:1"],
                           "worker": ["127.0.0.1:2"]},
               "task": {"type": "chief", "index": 0}}
  model_dir = tmp_path / "run"
  model_dir.mkdir()
  before = helpers.snapshot(str(model_dir))
  proc = helpers.run_script("train.py", *GPT, *CLUSTER, "--train_steps=2",
                            f"--model_dir={model_dir}", check=False,
                            env={"TF_CONFIG": json.dumps(tf_config)})
  helpers.assert_one_line_error(
      proc, "train.py", "mesh=data:2,model:2: data=2 needs 2 worker tasks "
      "(one per copy); TF_CONFIG has 1", unchanged=before)


def _train_losses(model_dir):
  losses = {}
  with open(os.path.join(model_dir, "metrics.jsonl")) as f:
    for line in f:
      record = json.loads(line)
      if record["split"] == "train" and record["name"] == "loss":
        losses[record["step"]] = record["value"]
  return losses


def _weights(model_dir):
  values = {}
  with h5py.File(os.path.join(model_dir, "model.weights.h5"), "r") as f:
    f.visititems(lambda name, item: values.__setitem__(name, item[()])
                 if isinstance(item, h5py.Dataset) else None)
  return values


def _relative(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def _launch(*args, timeout=900):
  return subprocess.run(
      [*LAUNCH, "--workers=2", "--grace_period=2", "--", *train_command(),
       *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
      env=ENV)


@pytest.fixture(scope="module")
def unsplit_run(tmp_path_factory):
  """The unsplit GPT, STEPS steps in one process."""
  model_dir = str(tmp_path_factory.mktemp("unsplit") / "run")
  helpers.run_script("train.py", *GPT, f"--train_steps={STEPS}",
                     f"--model_dir={model_dir}", timeout=900)
  return model_dir


@pytest.fixture(scope="module")
def split_run(tmp_path_factory):
  """The mesh across 2 worker processes, STEPS steps uninterrupted."""
  model_dir = str(tmp_path_factory.mktemp("split") / "run")
  proc = _launch(*GPT, *CLUSTER, f"--train_steps={STEPS}",
                 f"--model_dir={model_dir}")
  assert proc.returncode == 0, proc.stdout[-5000:]
  return model_dir, proc.stdout


def _assert_equals_unsplit(split_dir, unsplit_dir):
  want, got = _train_losses(unsplit_dir), _train_losses(split_dir)
  assert sorted(want) == sorted(got) == list(range(1, STEPS + 1))
  for step in want:
    assert _relative(got[step], want[step]) < TOLERANCE, (step, got, want)
  assert want[STEPS] < want[1] - 0.1  # it trained
  want, got = _weights(unsplit_dir), _weights(split_dir)
  assert sorted(want) == sorted(got) and want
  # Over all weights at once (a key bias has an exactly zero true gradient:
  # its own relative difference is noise over nothing).
  names = sorted(want)
  assert _relative(np.concatenate([np.ravel(got[n]) for n in names]),
                   np.concatenate([np.ravel(want[n]) for n in names])
                   ) < TOLERANCE


@pytest.mark.slow
def test_data_by_tensor_on_two_worker_processes_equals_unsplit(
    split_run, unsplit_run):
  split_dir, stdout = split_run
  # Copy r on worker r: both of a copy's shards in one process.
  placed = re.search(r"data x tensor: 2 copies of a 2-way tensor split on "
                     r"(.*)", stdout)
  assert placed, stdout[-3000:]
  assert placed.group(1).startswith(
      "(('/job:worker/replica:0/task:0/device:CPU:0', "
      "'/job:worker/replica:0/task:0/device:CPU:1'), "
      "('/job:worker/replica:0/task:1/device:CPU:0', "
      "'/job:worker/replica:0/task:1/device:CPU:1'))"), placed.group(1)
  assert "is not read by" not in stdout  # the mesh reads the cluster flag
  _assert_equals_unsplit(split_dir, unsplit_run)


@pytest.mark.slow
def test_relaunched_across_processes_resumes_to_the_uninterrupted_weights(
    tmp_path, split_run):
  # The restore of a sharded weight runs inside the workers' function,
  # where the restored value has no static shape: it once failed every
  # resume ("Cannot take the length of shape with unknown rank").
  model_dir = str(tmp_path / "run")
  first = _launch(*GPT, *CLUSTER, "--train_steps=2",
                  f"--model_dir={model_dir}")
  assert first.returncode == 0, first.stdout[-5000:]
  second = _launch(*GPT, *CLUSTER, f"--train_steps={STEPS}",
                   f"--model_dir={model_dir}")
  assert second.returncode == 0, second.stdout[-5000:]
  assert "Restored checkpoint" in second.stdout and "ckpt-2" in second.stdout
  want, got = _weights(split_run[0]), _weights(model_dir)
  assert sorted(want) == sorted(got) and want
  for name in want:
    np.testing.assert_array_equal(got[name], want[name], err_msg=name)
  want, got = _train_losses(split_run[0]), _train_losses(model_dir)
  assert got == want


@pytest.mark.slow
def test_a_one_process_checkpoint_resumes_on_the_cluster(
    tmp_path, unsplit_run):
  model_dir = str(tmp_path / "run")
  helpers.run_script("train.py", *GPT, "--train_steps=2",
                     f"--model_dir={model_dir}", timeout=900)
  proc = _launch(*GPT, *CLUSTER, f"--train_steps={STEPS}",
                 f"--model_dir={model_dir}")
  assert proc.returncode == 0, proc.stdout[-5000:]
  assert "Restored checkpoint" in proc.stdout
  _assert_equals_unsplit(model_dir, unsplit_run)


@pytest.mark.slow
def test_kill_9_of_a_worker_then_max_restarts_ends_with_the_same_weights(
    tmp_path, split_run):
  from tests import cluster_utils as cu  # pylint: disable=g-import-not-at-top
  model_dir, log = str(tmp_path / "run"), str(tmp_path / "launch.log")
  with open(log, "wb") as out:
    job = subprocess.Popen(
        [*LAUNCH, "--workers=2", "--max_restarts=1", "--grace_period=2",
         "--", *train_command(), *GPT, *CLUSTER, f"--train_steps={STEPS}",
         "--checkpoint_every=1", f"--model_dir={model_dir}"],
        cwd=ROOT, env=ENV, stdout=out, stderr=subprocess.STDOUT)
  try:
    deadline = time.monotonic() + 600
    while not re.search(r"^\[launch\] worker:1 pid=(\d+)", open(log).read(),
                        re.M):
      assert job.poll() is None and time.monotonic() < deadline, (
          open(log).read()[-4000:])
      time.sleep(0.05)
    pid = re.search(r"^\[launch\] worker:1 pid=(\d+)", open(log).read(),
                    re.M).group(1)
    killed_after = cu.wait_for_checkpoint(model_dir, 1, [job])
    os.kill(int(pid), signal.SIGKILL)
    code = cu.wait_exit(job, timeout=900)
  finally:
    cu.stop_all([job])
  output = open(log).read()
  assert code == 0, output[-4000:]
  assert killed_after < STEPS and "restart 1 of 1" in output, output[-4000:]
  restored = [int(s) for s in re.findall(
      r"^\[chief:0\].*Restored checkpoint .*/ckpt-(\d+)", output, re.M)]
  assert restored and restored[0] >= killed_after, output[-4000:]
  want, got = _weights(split_run[0]), _weights(model_dir)
  assert sorted(want) == sorted(got) and want
  for name in want:
    np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@pytest.mark.slow
def test_a_relaunch_with_sharded_optimizer_state_resumes(tmp_path,
                                                         unsplit_run):
  # A sharded slot's shard assigns through a function returning nothing:
  # its restore once grouped a None and failed every relaunch.
  model_dir = str(tmp_path / "run")
  for steps in (2, STEPS):
    proc = _launch(*GPT, *CLUSTER, "--shard_optimizer_state",
                   f"--train_steps={steps}", f"--model_dir={model_dir}")
    assert proc.returncode == 0, proc.stdout[-5000:]
  assert "Restored checkpoint" in proc.stdout
  _assert_equals_unsplit(model_dir, unsplit_run)


@pytest.mark.slow
def test_zero3_over_worker_processes_relaunched_equals_unsplit(
    tmp_path, unsplit_run):
  # The copies' shards on their workers; copy 0's whole weights on its
  # worker's host CPU (no device of the mesh keeps a whole weight).
  model_dir = str(tmp_path / "run")
  zero3 = ["--shard_optimizer_state", "--shard_gradients",
           "--shard_parameters"]
  for steps in (2, STEPS):
    proc = _launch(*GPT, *CLUSTER, *zero3, f"--train_steps={steps}",
                   f"--model_dir={model_dir}")
    assert proc.returncode == 0, proc.stdout[-5000:]
  assert "Restored checkpoint" in proc.stdout
  placed = re.findall(r"copy 0's whole weights on (.*)$", proc.stdout, re.M)
  assert placed == ["/job:worker/replica:0/task:0/device:CPU:0"], (
      placed, proc.stdout[-5000:])
  _assert_equals_unsplit(model_dir, unsplit_run)
