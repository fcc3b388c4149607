"""A cluster that loses a worker for good shrinks and goes on: launch.py
--min_workers. The survivors resume from the last checkpoint with the same
global batch and train on exactly the examples an uninterrupted run sees.
"""

import collections
import os
import re
import signal
import subprocess
import textwrap
import time

import numpy as np
import pytest

import cluster_utils as cu
import helpers
from framework.distribute import launcher

EXAMPLES, BATCH = 240, 12  # one epoch: 20 steps of 12 = 4 x 3 = 6 x 2
STEPS = EXAMPLES // BATCH
CHECKPOINT_EVERY = 4

# A model that writes each training batch's example ids (feature 0 of the
# numpy data) to a file of its process, named by its cluster's worker count
# and task index, and trains on the other features. Each step sleeps a
# little, so that the worker is killed while the run goes on.
MODEL = textwrap.dedent('''
    import json
    import os
    import time

    import keras
    import tensorflow as tf

    IDS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ids")


    class RecordIds(keras.layers.Layer):

      def call(self, x, training=None):
        if training:
          tf_config = json.loads(os.environ.get("TF_CONFIG") or "{}")
          workers = len(tf_config.get("cluster", {}).get("worker", []))
          index = tf_config.get("task", {}).get("index", 0)
          path = os.path.join(IDS, f"w{workers}_t{index}_{os.getpid()}.txt")
          nap = tf.py_function(lambda: time.sleep(0.15) or 0, [], tf.int32)
          with tf.control_dependencies([nap, tf.print(
              tf.cast(x[:, 0], tf.int64), summarize=-1,
              output_stream="file://" + path)]):
            x = tf.identity(x)
        return x[:, 1:]


    def build(input_shape, num_classes):
      inputs = keras.Input(input_shape)
      hidden = keras.layers.Dense(16, activation="relu")(RecordIds()(inputs))
      return keras.Model(inputs, keras.layers.Dense(num_classes)(hidden))
''')

# Worker 2 does not come back once DEAD exists: its relaunch exits at once.
WRAPPER = textwrap.dedent('''\
    #!/bin/sh
    case "$TF_CONFIG" in
      *'"index": 2'*) [ -e "{dead}" ] && {{ echo "worker 2 is gone"; exit 1; }} ;;
    esac
    exec "$@"
''')


def _write_data(path):
  rng = np.random.default_rng(0)

  def split(n):
    x = rng.normal(size=(n, 5)).astype(np.float32)
    x[:, 0] = np.arange(n)  # the example's id
    return x, (x[:, 1] + x[:, 2] > 0).astype(np.int32)

  x_train, y_train = split(EXAMPLES)
  x_test, y_test = split(24)
  np.savez(path, x_train=x_train, y_train=y_train, x_test=x_test,
           y_test=y_test)


def _flags(folder, model_dir):
  return ["--model=ids_model:build", "--dataset=numpy",
          f"--data_dir={folder / 'data.npz'}", f"--global_batch_size={BATCH}",
          f"--train_steps={STEPS}", "--steps_per_loop=2",
          f"--checkpoint_every={CHECKPOINT_EVERY}", "--log_every=2",
          "--summary_every=2", "--eval_every=0", f"--model_dir={model_dir}"]


def _batches(folder, prefix):
  """{file name: [ids of each training call, in order]} of `prefix*`."""
  found = {}
  for name in sorted(os.listdir(folder / "ids")):
    if name.startswith(prefix):
      text = open(folder / "ids" / name).read()
      found[name] = [tuple(map(int, re.findall(r"\d+", line)))
                     for line in text.splitlines() if line.strip()]
  return found


def _steps(batches, reference):
  """The step of each batch: the reference step whose batch holds it."""
  where = {i: step for step, batch in enumerate(reference) for i in batch}
  steps = []
  for batch in batches:
    [step] = {where[i] for i in batch}
    steps.append(step)
  return steps


@pytest.mark.slow
def test_a_worker_lost_for_good_leaves_two_that_finish_on_the_same_examples(
    tmp_path):
  (tmp_path / "ids").mkdir()
  (tmp_path / "ids_model.py").write_text(MODEL)
  _write_data(tmp_path / "data.npz")
  dead = tmp_path / "DEAD"
  wrapper = tmp_path / "task.sh"
  wrapper.write_text(WRAPPER.format(dead=dead))
  wrapper.chmod(0o755)

  # The uninterrupted run, one process: its batches are the reference.
  single = tmp_path / "single"
  proc = helpers.run_script("train.py", *_flags(tmp_path, single),
                            cwd=str(tmp_path), timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  [reference] = _batches(tmp_path, "w0_").values()
  assert len(reference) == STEPS
  assert sorted(i for b in reference for i in b) == list(range(EXAMPLES))

  model_dir = tmp_path / "cluster"
  log = tmp_path / "launch.log"
  with open(log, "w") as out:
    launch = subprocess.Popen(
        cu.LAUNCH + ["--workers=3", "--min_workers=2", "--max_restarts=2",
                     "--rejoin_timeout=60", "--grace_period=5", "--",
                     str(wrapper)] + cu.train_command() +
        ["--strategy=multi_worker_mirrored"] + _flags(tmp_path, model_dir),
        cwd=str(tmp_path), env=cu.ENV, stdout=out, stderr=subprocess.STDOUT)
  try:
    cu.wait_for_checkpoint(str(model_dir), CHECKPOINT_EVERY, [launch])
    [pid] = re.findall(r"^\[launch\] worker:2 pid=(\d+)", log.read_text(),
                       re.M)
    dead.write_text("")
    os.kill(int(pid), signal.SIGKILL)
    status = cu.wait_exit(launch, 900)
  finally:
    cu.stop_all([launch])
  output = log.read_text()
  assert status == 0, output[-5000:]
  assert "worker:2 did not come back" in output, output[-5000:]
  assert "as a cluster of 2 workers" in output, output[-5000:]
  assert cu.global_step(str(model_dir)) == STEPS

  # The three workers' steps up to the checkpoint the two resumed from,
  # then the two workers' steps from there: each step's global batch is
  # the reference's, split over the replicas, and every example of the
  # epoch is trained on exactly once.
  three, two = _batches(tmp_path, "w3_"), _batches(tmp_path, "w2_")
  assert len(three) == 3 and len(two) == 2, (sorted(three), sorted(two))
  resumed_at = min(min(_steps(b, reference)) for b in two.values())
  assert 0 < resumed_at < STEPS and resumed_at % CHECKPOINT_EVERY == 0
  trained = collections.defaultdict(list)
  for files, first, last, size in ((three, 0, resumed_at, BATCH // 3),
                                   (two, resumed_at, STEPS, BATCH // 2)):
    for batches in files.values():
      steps = _steps(batches, reference)
      assert steps[:last - first] == list(range(first, last))
      assert all(len(b) == size for b in batches)
      for step, batch in zip(steps, batches):
        if step < last:
          trained[step] += batch
  assert {s: sorted(b) for s, b in trained.items()} == {
      s: sorted(b) for s, b in enumerate(reference)}
  seen = collections.Counter(i for b in trained.values() for i in b)
  assert sorted(seen) == list(range(EXAMPLES)) and set(seen.values()) == {1}
  print(f"resumed at step {resumed_at}: {resumed_at * BATCH} examples on 3 "
        f"workers, {(STEPS - resumed_at) * BATCH} on 2; every one of the "
        f"{EXAMPLES} once")

  # The same weights as the uninterrupted run (the same global batches;
  # only the order of the sums differs).
  assert cu.max_weight_difference(str(model_dir), str(single)) <= 1e-5


TRAIN = ["python", "scripts/train.py", "--strategy=multi_worker_mirrored"]


@pytest.mark.parametrize("flags, fragments", [
    (["--min_workers=4"], ["min_workers=4", "from 1 to workers=3"]),
    (["--min_workers=0"], ["min_workers=0", "from 1 to workers=3"]),
    (["--rejoin_timeout=0"], ["rejoin_timeout=0", "> 0"]),
    (["--rejoin_timeout=-5"], ["rejoin_timeout=-5", "> 0"]),
    (["--min_workers=2"], ["max_restarts >= 2", "max_restarts=0"]),
    (["--min_workers=2", "--max_restarts=2", "--", *TRAIN,
      "--dataset=text", "--global_batch_size=60"],
     ["dataset=text", "depend on the worker count", "synthetic"]),
    (["--min_workers=2", "--max_restarts=2", "--", *TRAIN,
      "--dataset=synthetic", "--global_batch_size=64"],
     ["global_batch_size=64", "3 workers", "multiple of 6"]),
    (["--min_workers=2", "--max_restarts=2", "--ps=1", "--", "python",
      "scripts/train.py", "--strategy=parameter_server"],
     ["min_workers=2", "multi_worker_mirrored"]),
])
def test_bad_shrink_settings_are_one_line_before_anything_starts(
    tmp_path, flags, fragments):
  if "--" not in flags:
    flags = flags + ["--", *TRAIN, "--dataset=synthetic",
                     "--global_batch_size=60"]
  flags = [f.replace("scripts/train.py", cu.TRAIN[1]) for f in flags]
  model_dir = tmp_path / "run"
  proc = helpers.run_script("launch.py", "--workers=3", *flags,
                            f"--model_dir={model_dir}", check=False,
                            timeout=120)
  helpers.assert_one_line_error(proc, "launch.py", *fragments)
  assert "[launch]" not in proc.stdout  # no task was started
  assert not model_dir.exists()


def test_the_launcher_shrinks_only_a_worker_that_failed_twice_quickly():
  job = launcher.Launcher(["true"], launcher.local_cluster(3),
                          min_workers=2, rejoin_timeout=10, max_restarts=5)
  job._started_at = 0  # pylint: disable=protected-access
  job._failed_after = 1  # pylint: disable=protected-access
  assert not job._lost("worker", 2)  # its first failure: relaunched
  job._missing = 2  # pylint: disable=protected-access
  assert job._lost("worker", 2)  # failed again within rejoin_timeout
  assert not job._lost("worker", 1)  # another worker: relaunched
  assert not job._lost("chief", 2)
  job._failed_after = 11  # pylint: disable=protected-access
  assert not job._lost("worker", 2)  # it came back, then failed
  job._failed_after, job.workers = 1, 2  # pylint: disable=protected-access
  assert not job._lost("worker", 2)  # at --min_workers already
