"""Model parallelism over cluster tasks: pieces on /job:worker/task:i."""

import json
import os
import signal
import subprocess

import h5py
import numpy as np
import pytest

from framework.distribute import launcher
from tests.cluster_utils import (LAUNCH, MLP, ROOT, ENV, log_tail,
                                 train_command,
                                 start_task, wait_for_checkpoint,
                                 wait_listening)
from tests.helpers import run_script

SEED_EXAMPLE = ["--hidden_units=10", "--train_steps=6", "--steps_per_loop=2",
                "--log_every=2", "--summary_every=2", "--checkpoint_every=2",
                "--export_saved_model=false"]


def _weights(model_dir):
  values = {}
  with h5py.File(os.path.join(model_dir, "model.weights.h5"), "r") as f:
    f.visititems(lambda name, item: values.__setitem__(name, item[()])
                 if isinstance(item, h5py.Dataset) else None)
  return values


def _errors(text):
  return [l for l in text.splitlines() if "train.py: error:" in l]


@pytest.mark.slow
def test_seed_example_10_units_as_5_plus_5_on_two_workers_equals_unsplit(
    tmp_path):
  split_dir, unsplit_dir = str(tmp_path / "split"), str(tmp_path / "unsplit")
  proc = subprocess.run(
      [*LAUNCH, "--workers=2", "--grace_period=2", "--", *train_command(),
       *MLP, *SEED_EXAMPLE, "--model_parallel=tensor", "--num_shards=2",
       "--model_parallel_devices=cluster", f"--model_dir={split_dir}"],
      capture_output=True, text=True, timeout=600, cwd=ROOT, env=ENV)
  assert proc.returncode == 0, proc.stdout[-4000:]
  # The launcher added a chief; the shards lived on the two workers.
  assert "[launch] chief:0" in proc.stdout
  memory = [l for l in proc.stdout.splitlines()
            if "model-parallel memory per device" in l]
  assert memory and "/job:worker/task:1/CPU:0" in memory[0], memory
  run_script("train.py", *MLP, *SEED_EXAMPLE, f"--model_dir={unsplit_dir}",
             timeout=600)
  want, got = _weights(unsplit_dir), _weights(split_dir)
  assert sorted(want) == sorted(got) and want
  for name in want:
    np.testing.assert_allclose(got[name], want[name], rtol=0, atol=1e-5,
                               err_msg=name)


@pytest.mark.slow
def test_a_dead_stage_task_is_one_clear_line_and_a_relaunch_resumes(
    tmp_path):
  cluster = launcher.local_cluster(2, chief=True)
  args = [*MLP, "--hidden_units=16,16", "--model_parallel=pipeline",
          "--num_stages=2", "--model_parallel_devices=cluster",
          "--train_steps=100000", "--checkpoint_every=2",
          "--steps_per_loop=2", "--export_saved_model=false",
          f"--model_dir={tmp_path / 'run'}"]
  workers = [start_task(cluster, "worker", i, args,
                        str(tmp_path / f"worker{i}.log")) for i in range(2)]
  chief = None
  try:
    wait_listening(cluster, ["worker"], workers)
    chief = start_task(cluster, "chief", 0, args, str(tmp_path / "chief.log"))
    wait_for_checkpoint(str(tmp_path / "run"), 2, [chief] + workers,
                        timeout=300)
    workers[1].send_signal(signal.SIGKILL)
    try:
      code = chief.wait(timeout=120)
    except subprocess.TimeoutExpired:
      raise AssertionError("the chief hung after stage 1's task died"
                           f"{log_tail(chief)}") from None
    text = open(chief.log_path, errors="replace").read()
    assert code == 1, f"exit {code}{log_tail(chief)}"
    assert "Traceback" not in text, log_tail(chief)
    errors = _errors(text)
    assert len(errors) == 1, log_tail(chief)
    assert "a task of the cluster failed" in errors[0], errors
    assert "relaunch" in errors[0], errors
    # The relaunch (fresh tasks, as a scheduler would start) resumes from
    # the last checkpoint and trains on to its end.
    for process in workers:
      if process.poll() is None:
        process.kill()
        process.wait()
    last = wait_for_checkpoint(str(tmp_path / "run"), 0, [], timeout=1)
    cluster = launcher.local_cluster(2, chief=True)
    args = [a if not a.startswith("--train_steps=") else
            f"--train_steps={last + 4}" for a in args]
    workers = [start_task(cluster, "worker", i, args,
                          str(tmp_path / f"relaunch_worker{i}.log"))
               for i in range(2)]
    wait_listening(cluster, ["worker"], workers)
    chief = start_task(cluster, "chief", 0, args,
                       str(tmp_path / "relaunch_chief.log"))
    code = chief.wait(timeout=600)
    text = open(chief.log_path, errors="replace").read()
    assert code == 0, f"exit {code}{log_tail(chief)}"
    assert f"Restored checkpoint {tmp_path / 'run'}/ckpt-{last}" in text, (
        log_tail(chief))
    assert wait_for_checkpoint(str(tmp_path / "run"), last + 4, [],
                               timeout=1) == last + 4
  finally:
    for process in workers + ([chief] if chief else []):
      if process.poll() is None:
        process.kill()
        process.wait()


@pytest.mark.parametrize("tf_config, flags, message", [
    (None, ["--model_parallel=tensor"],
     "model_parallel_devices=cluster needs TF_CONFIG describing a chief and "
     "2 worker tasks; it is not set"),
    ({"cluster": {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]},
      "task": {"type": "chief", "index": 0}},
     ["--model_parallel=pipeline", "--num_stages=2"],
     "model_parallel_devices=cluster with num_stages=2 needs 2 worker tasks "
     "(one per piece); TF_CONFIG has 1"),
    ({"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
      "task": {"type": "worker", "index": 0}},
     ["--model_parallel=tensor"],
     "model_parallel_devices=cluster needs a chief task"),
    (None, [], "model_parallel_devices=cluster places the pieces of a split "
     "model; set --model_parallel=pipeline or tensor"),
])
def test_bad_cluster_setups_are_one_clear_line(tf_config, flags, message,
                                               tmp_path):
  env = {"TF_CONFIG": json.dumps(tf_config) if tf_config else None}
  proc = run_script("train.py", *MLP, "--train_steps=2",
                    "--model_parallel_devices=cluster", *flags,
                    f"--model_dir={tmp_path}", env=env, check=False,
                    timeout=120)
  assert proc.returncode == 1, proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr
  errors = _errors(proc.stderr)
  assert len(errors) == 1 and message in errors[0], errors
  assert not os.listdir(tmp_path)  # --model_dir untouched


def test_launcher_adds_a_chief_and_serving_workers_for_cluster_splits():
  command = ["python", "train.py", "--model_parallel_devices=cluster"]
  assert launcher.model_parallel_on_cluster(command)
  assert launcher.model_parallel_on_cluster(
      ["train.py", "--model_parallel_devices", "cluster"])
  assert not launcher.model_parallel_on_cluster(["train.py"])
  cluster = launcher.local_cluster(2, chief=True)
  assert launcher.is_server(cluster, "worker", serving_workers=True)
  assert not launcher.is_server(cluster, "worker")
  assert not launcher.is_server(cluster, "chief", serving_workers=True)
