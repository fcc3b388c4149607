"""Damaged checkpoints, two writers, orphans, config changes and full disks.

Every test runs the real scripts in fresh processes on a tiny run (mlp on
synthetic data) and damages files for real: deleted, truncated and
bit-flipped checkpoint files, a full tmpfs (or RLIMIT_FSIZE where mounting
is not allowed), a read-only mount.
"""

import glob
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

import disk_faults
from helpers import ROOT, run_script

COMMON = ["--model=mlp", "--dataset=synthetic", "--hidden_units=16",
          "--global_batch_size=32", "--optimizer=momentum",
          "--learning_rate=0.05", "--steps_per_loop=5",
          "--checkpoint_every=10", "--keep_checkpoints=5",
          "--export_saved_model=false"]
DATA = "ckpt-20.data-00000-of-00001"


def train(model_dir, *args, check=True, **kwargs):
  return run_script("train.py", *COMMON, f"--model_dir={model_dir}", *args,
                    check=check, **kwargs)


def snapshot(model_dir):
  """Path -> (size, mtime, sha256) of everything under model_dir."""
  out = {}
  for path in glob.glob(f"{model_dir}/**", recursive=True):
    stat = os.stat(path)
    digest = None
    if os.path.isfile(path):
      with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    out[path] = (stat.st_size, stat.st_mtime_ns, digest)
  return out


def assert_one_line_error(proc, *fragments, script="train.py"):
  """Exit 1, exactly one `<script>: error: ...` line holding `fragments`,
  no traceback."""
  assert proc.returncode == 1, proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
  lines = [l for l in proc.stderr.splitlines()
           if l.startswith(f"{script}: error: ")]
  assert len(lines) == 1, proc.stderr[-3000:]
  for fragment in fragments:
    assert fragment in lines[0], lines[0]
  return lines[0]


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
  """A run of 20 steps with ckpt-10 and ckpt-20 (copied by each test)."""
  model_dir = tmp_path_factory.mktemp("base") / "run"
  train(model_dir, "--train_steps=20")
  assert os.path.exists(model_dir / "ckpt-10.index")
  assert os.path.exists(model_dir / "ckpt-20.index")
  return model_dir


@pytest.fixture
def run_dir(base_run, tmp_path):
  model_dir = tmp_path / "run"
  shutil.copytree(base_run, model_dir)
  return model_dir


def truncate(path):
  os.truncate(path, 1000)


def flip_bit(path):
  with open(path, "r+b") as f:
    f.seek(os.path.getsize(path) // 2)
    byte = f.read(1)
    f.seek(-1, os.SEEK_CUR)
    f.write(bytes([byte[0] ^ 0x10]))


DAMAGE = {"truncate": truncate, "flip": flip_bit, "delete": os.remove}


def test_missing_newest_index_falls_back_and_keeps_older(run_dir):
  os.remove(run_dir / "ckpt-20.index")
  # --restore=error: one line naming the file, nothing touched.
  before = snapshot(run_dir)
  proc = train(run_dir, "--train_steps=40", "--restore=error", check=False)
  assert_one_line_error(proc, "ckpt-20.index", "latest_intact")
  assert snapshot(run_dir) == before
  ckpt10 = {p: v for p, v in before.items() if "ckpt-10." in p}
  assert len(ckpt10) == 2
  # Default: a warning naming the file, resume from ckpt-10, on to step 40.
  proc = train(run_dir, "--train_steps=40", "--log_every=5")
  warnings = [l for l in proc.stderr.splitlines()
              if l.startswith("W") and "ckpt-20.index is missing" in l]
  assert warnings, proc.stderr[-3000:]
  assert f"Restored checkpoint {run_dir}/ckpt-10" in proc.stderr
  assert "train step 15/40" in proc.stderr
  assert "train step 10/40" not in proc.stderr  # not a fresh start
  after = snapshot(run_dir)
  assert {p: after.get(p) for p in ckpt10} == ckpt10  # ckpt-10 untouched
  for step in (20, 30, 40):
    assert os.path.exists(run_dir / f"ckpt-{step}.index")
  with open(run_dir / "checkpoint") as f:
    assert 'model_checkpoint_path: "ckpt-40"' in f.read()


@pytest.mark.slow
@pytest.mark.parametrize("how", sorted(DAMAGE))
def test_damaged_data_file_is_one_line(run_dir, how):
  DAMAGE[how](run_dir / DATA)
  before = snapshot(run_dir)
  proc = run_script("evaluate.py", f"--model_dir={run_dir}",
                    f"--checkpoint={run_dir}/ckpt-20", check=False)
  line = assert_one_line_error(proc, DATA, script="evaluate.py")
  assert "model" not in line.split(DATA)[1]  # not blamed on the flags
  if how == "truncate":
    # evaluate.py without --checkpoint: the newest intact one, warned.
    proc = run_script("evaluate.py", f"--model_dir={run_dir}")
    assert f"checkpoint {run_dir}/ckpt-10 (step 10)" in proc.stdout
    assert any(DATA in l for l in proc.stderr.splitlines()
               if l.startswith("W")), proc.stderr[-3000:]
    # train.py: warns, resumes from ckpt-10.
    proc = train(run_dir, "--train_steps=30", "--log_every=5")
    assert "train step 15/30" in proc.stderr
    assert f"Restored checkpoint {run_dir}/ckpt-10" in proc.stderr
    assert any(DATA in l and "damaged" in l for l in proc.stderr.splitlines()
               if l.startswith("W")), proc.stderr[-3000:]
    assert "train step 10/30" not in proc.stderr
  else:
    assert {p: v for p, v in snapshot(run_dir).items()
            if "eval" not in p} == {p: v for p, v in before.items()
                                    if "eval" not in p}


def test_all_checkpoints_damaged_is_one_line(run_dir):
  truncate(run_dir / DATA)
  truncate(run_dir / "ckpt-10.data-00000-of-00001")
  before = snapshot(run_dir)
  proc = train(run_dir, "--train_steps=40", check=False)
  assert_one_line_error(proc, "no intact checkpoint", DATA,
                        "ckpt-10.data-00000-of-00001")
  assert snapshot(run_dir) == before


def test_config_mismatch_is_one_line_unless_allowed(run_dir):
  before = snapshot(run_dir)
  proc = train(run_dir, "--train_steps=30", "--optimizer=sgd", check=False)
  assert_one_line_error(proc, 'optimizer was "momentum", now "sgd"',
                        "allow_config_change")
  proc = train(run_dir, "--train_steps=30", "--global_batch_size=64",
               check=False)
  assert_one_line_error(proc, "global_batch_size was 32, now 64")
  assert snapshot(run_dir) == before
  proc = train(run_dir, "--train_steps=30", "--optimizer=sgd",
               "--allow_config_change")
  assert any("changed configuration" in l and "sgd" in l
             for l in proc.stderr.splitlines() if l.startswith("W"))
  assert f"Restored checkpoint {run_dir}/ckpt-20" in proc.stderr
  with open(run_dir / "run_config.json") as f:
    assert '"optimizer": "sgd"' in f.read()  # the new run's from now on


def test_orphan_cleanup_keeps_user_files(run_dir):
  orphans = ["ckpt-9_temp", "ckpt-30_temp_" + "0123456789abcdef" * 2,
             ".tmp_worker_worker_1"]
  user = ["notes_temp_v2.txt", "results_temp_old", "my_temp",
          "ckpt-9_temp_notes"]
  for name in orphans + ["results_temp_old", "my_temp"]:
    os.mkdir(run_dir / name)
    (run_dir / name / "part-00000").write_text("half-written")
  for name in ("notes_temp_v2.txt", "ckpt-9_temp_notes"):
    (run_dir / name).write_text("mine")
  train(run_dir, "--train_steps=20")  # nothing to train; cleans up
  assert not [n for n in orphans if os.path.exists(run_dir / n)]
  assert all(os.path.exists(run_dir / n) for n in user)


def test_empty_model_dir_is_one_line(tmp_path):
  proc = run_script("train.py", *COMMON, "--model_dir=", "--train_steps=2",
                    cwd=tmp_path, check=False)
  assert_one_line_error(proc, "model_dir=''")
  assert not os.listdir(tmp_path)


def test_file_or_read_only_model_dir_is_one_line(tmp_path):
  not_dir = tmp_path / "file"
  not_dir.write_text("x")
  proc = train(not_dir, "--train_steps=2", check=False)
  assert_one_line_error(proc, str(not_dir), "is a file")
  assert not_dir.read_text() == "x"
  read_only = tmp_path / "ro"
  read_only.mkdir()
  with disk_faults.mounted(read_only, "ro") as mounted:
    if not mounted:
      pytest.skip("cannot mount a read-only tmpfs here")
    proc = train(read_only, "--train_steps=2", check=False)
    assert_one_line_error(proc, str(read_only), "read-only file system")


def test_disk_full_keeps_the_previous_weights(run_dir, tmp_path):
  mount = tmp_path / "disk"
  mount.mkdir()
  with disk_faults.mounted(mount, "size=3m") as mounted:
    if mounted:
      # A real full disk: room for the small files, not for the weights.
      model_dir = mount / "run"
      shutil.copytree(run_dir, model_dir)
      disk_faults.fill(mount, 32768)
      kwargs, reason = {}, "No space left on device"
    else:
      model_dir = run_dir
      kwargs = {"preexec_fn": disk_faults.limit_file_size}
      reason = "File too large"
    weights = model_dir / "model.weights.h5"
    before = snapshot(model_dir)[str(weights)]
    # Already at step 20: restores, evaluates, rewrites the weights.
    proc = _train_with(model_dir, "--train_steps=20", **kwargs)
    assert_one_line_error(proc, "model.weights.h5", reason,
                          "previous version is unchanged")
    assert snapshot(model_dir)[str(weights)] == before
    assert not glob.glob(f"{model_dir}/.tmp_*")


def _train_with(model_dir, *args, preexec_fn=None):
  if preexec_fn is None:
    return run_script("train.py", *COMMON, f"--model_dir={model_dir}", *args,
                      check=False)
  return subprocess.run(
      [sys.executable, os.path.join(ROOT, "scripts", "train.py"), *COMMON,
       f"--model_dir={model_dir}", *args], cwd=ROOT,
      env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"), capture_output=True,
      text=True, timeout=300, preexec_fn=preexec_fn)


def test_predict_on_a_damaged_weights_file_is_one_line(run_dir, tmp_path):
  from PIL import Image  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  png = tmp_path / "image.png"
  Image.fromarray(np.full((32, 32, 3), 128, np.uint8)).save(png)
  truncate(run_dir / "model.weights.h5")
  proc = run_script("predict.py", f"--model_dir={run_dir}", f"--image={png}",
                    check=False)
  line = assert_one_line_error(proc, "model.weights.h5", "damaged",
                               script="predict.py")
  assert "model=" not in line and "options" not in line


def test_second_writer_is_refused(tmp_path):
  model_dir = tmp_path / "run"
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
  log = open(tmp_path / "first.log", "w+")  # pylint: disable=consider-using-with
  first = subprocess.Popen(
      [sys.executable, os.path.join(ROOT, "scripts", "train.py"), *COMMON,
       f"--model_dir={model_dir}", "--train_steps=1000000",
       "--steps_per_loop=50", "--log_every=1000", "--summary_every=1000",
       "--checkpoint_every=0"],
      cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
  try:
    lock = model_dir / ".distloop.lock"
    deadline = time.time() + 600  # only stops a hang
    while not lock.exists() and first.poll() is None:
      assert time.time() < deadline
      time.sleep(0.5)
    assert first.poll() is None, (tmp_path / "first.log").read_text()
    proc = train(model_dir, "--train_steps=40", "--seed=7", check=False)
    assert_one_line_error(proc, f"model_dir='{model_dir}' is in use by pid "
                          f"{first.pid} on host")
    assert first.poll() is None  # the first run goes on
    first.send_signal(signal.SIGTERM)  # saves and exits 42 (preemption)
    first.wait(timeout=600)
  finally:
    if first.poll() is None:
      first.kill()
    log.close()
  stderr = (tmp_path / "first.log").read_text()
  assert first.returncode == 42, stderr[-3000:]
  assert "Traceback" not in stderr
  assert not lock.exists()
  # Its checkpoint is intact and the lock is free again.
  proc = train(model_dir, "--train_steps=1")
  assert "Restored checkpoint" in proc.stderr
