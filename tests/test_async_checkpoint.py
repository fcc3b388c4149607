"""--async_checkpoint: the checkpoints written in the background are the
synchronous run's, a kill -9 in the middle of a write leaves the previous
checkpoint and the relaunch resumes exactly, a failed write is one line and
no partial checkpoint, and a run of several processes is refused before
anything is written."""

import glob
import json
import os
import re
import textwrap

import numpy as np
import pytest
import tensorflow as tf

from helpers import run_code, run_script

COMMON = ["--model=mlp", "--dataset=synthetic", "--hidden_units=16",
          "--global_batch_size=16", "--steps_per_loop=2",
          "--checkpoint_every=2", "--keep_checkpoints=2", "--eval_steps=1",
          "--noexport_saved_model", "--train_steps=6"]

# train.py with a hook in the background write of ckpt-4, after its files
# are copied under temporary names and before they are renamed and listed.
HOOKED_TRAIN = textwrap.dedent("""
    import errno, os, signal, sys, time
    from absl import app
    from framework.core.checkpoints import manager
    what = os.environ["AT_CKPT_4"]
    def hook(prefix):
      if prefix.endswith("ckpt-4"):
        if what == "kill":
          os.kill(os.getpid(), signal.SIGKILL)
        if what == "term":  # the write goes on while the signal lands
          os.kill(os.getpid(), signal.SIGTERM)
          time.sleep(1)
          return
        raise OSError(errno.ENOSPC, "No space left on device")
    manager._WRITE_HOOKS.append(hook)
    from scripts import train
    sys.argv[0] = "train.py"
    app.run(train.main)
""")


def _digest(proc):
  return re.search(r"final weights sha256=(\w+)", proc.stderr).group(1)


def _tensors(prefix):
  reader = tf.train.load_checkpoint(prefix)
  return {k: reader.get_tensor(k)
          for k in reader.get_variable_to_shape_map()
          if k != "_CHECKPOINTABLE_OBJECT_GRAPH"}


def _listed(model_dir):
  state = tf.train.get_checkpoint_state(model_dir)
  return [os.path.basename(p) for p in state.all_model_checkpoint_paths]


@pytest.fixture(scope="module")
def synchronous(tmp_path_factory):
  model_dir = str(tmp_path_factory.mktemp("sync") / "run")
  return model_dir, run_script("train.py", *COMMON, f"--model_dir={model_dir}")


def test_background_saves_equal_the_synchronous_ones(synchronous, tmp_path):
  sync_dir, sync = synchronous
  model_dir = str(tmp_path / "run")
  proc = run_script("train.py", *COMMON, "--async_checkpoint",
                    f"--model_dir={model_dir}")
  assert _digest(proc) == _digest(sync)
  assert _listed(model_dir) == _listed(sync_dir) == ["ckpt-4", "ckpt-6"]
  for name in _listed(model_dir):
    ours = _tensors(os.path.join(model_dir, name))
    theirs = _tensors(os.path.join(sync_dir, name))
    assert sorted(ours) == sorted(theirs)
    for key, value in ours.items():
      np.testing.assert_array_equal(value, theirs[key], err_msg=key)
  assert not glob.glob(os.path.join(model_dir, "*tempstate*"))


def test_kill_9_in_a_background_write_resumes_exactly(synchronous, tmp_path):
  _, sync = synchronous
  model_dir = str(tmp_path / "run")
  args = [*COMMON, "--async_checkpoint", f"--model_dir={model_dir}"]
  killed = run_code(HOOKED_TRAIN, *args,
                    env={"AT_CKPT_4": "kill"})
  assert killed.returncode == -9, killed.stderr[-2000:]
  # ckpt-4 was written under temporary names only: ckpt-2 stays the newest.
  assert _listed(model_dir) == ["ckpt-2"]
  assert glob.glob(os.path.join(model_dir, "ckpt-4.*tempstate*"))
  proc = run_script("train.py", *args)
  assert "Restored checkpoint" in proc.stderr
  assert _digest(proc) == _digest(sync)
  assert _listed(model_dir) == ["ckpt-4", "ckpt-6"]
  assert not glob.glob(os.path.join(model_dir, "*tempstate*"))


def test_sigterm_in_a_background_write_keeps_it_and_resumes_exactly(
    synchronous, tmp_path):
  """SIGTERM (a preemption) while ckpt-4 is being written: the write is
  waited for, never left half-listed; the relaunch ends on the
  uninterrupted run's weights."""
  _, sync = synchronous
  model_dir = str(tmp_path / "run")
  args = [*COMMON, "--async_checkpoint", f"--model_dir={model_dir}"]
  stopped = run_code(HOOKED_TRAIN, *args, env={"AT_CKPT_4": "term"})
  assert "Traceback" not in stopped.stderr, stopped.stderr[-3000:]
  assert "ckpt-4" in _listed(model_dir), stopped.stderr[-3000:]
  assert not glob.glob(os.path.join(model_dir, "*tempstate*"))
  proc = run_script("train.py", *args)
  assert _digest(proc) == _digest(sync)
  assert _listed(model_dir)[-1] == "ckpt-6"


def test_a_failed_background_write_is_one_line_and_no_partial_checkpoint(
    tmp_path):
  model_dir = str(tmp_path / "run")
  proc = run_code(HOOKED_TRAIN, *COMMON, "--async_checkpoint",
                  f"--model_dir={model_dir}",
                  env={"AT_CKPT_4": "fail"})
  assert proc.returncode != 0
  errors = [l for l in proc.stderr.splitlines() if "error:" in l]
  assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
  assert ("cannot write checkpoint ckpt-4" in errors[0]
          and "No space left on device" in errors[0]
          and "the last good checkpoint is" in errors[0]
          and "ckpt-2 (unchanged)" in errors[0]), errors[0]
  assert _listed(model_dir) == ["ckpt-2"]
  assert not glob.glob(os.path.join(model_dir, "ckpt-4*"))


@pytest.mark.parametrize("strategy,cluster", [
    ("parameter_server", {"chief": ["localhost:1"], "worker": ["localhost:2"],
                          "ps": ["localhost:3"]}),
    ("multi_worker_mirrored", {"worker": ["localhost:1", "localhost:2"]})])
def test_several_processes_are_refused_before_anything_is_written(
    tmp_path, strategy, cluster):
  model_dir = tmp_path / "run"
  task = "chief" if "chief" in cluster else "worker"
  tf_config = json.dumps({"cluster": cluster,
                          "task": {"type": task, "index": 0}})
  proc = run_script("train.py", *COMMON, "--async_checkpoint",
                    f"--strategy={strategy}", f"--model_dir={model_dir}",
                    env={"TF_CONFIG": tf_config}, check=False)
  assert proc.returncode != 0
  lines = [l for l in proc.stderr.splitlines() if "error:" in l]
  assert len(lines) == 1 and "async_checkpoint" in lines[0], proc.stderr[-2000:]
  assert not model_dir.exists()
