"""A checkpoint of variables on a task that died is a cluster error, not a
disk error (real processes on 127.0.0.1)."""

import os
import textwrap

import pytest

import helpers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The chief: a variable on the worker task, one good save, the worker
# killed, one more save. Prints the second save's outcome.
CHIEF = textwrap.dedent("""
    import json, os, signal, subprocess, sys, time
    import tensorflow as tf
    from framework.core.checkpoints.manager import CheckpointManager
    from framework.distribute import launcher
    from framework.errors import ModelDirError

    model_dir = sys.argv[1]
    cluster = launcher.local_cluster(1, chief=True)
    worker = subprocess.Popen([sys.executable, "-c", (
        "import tensorflow as tf, sys, json;"
        "tf.distribute.Server(tf.train.ClusterSpec(json.loads(sys.argv[1])),"
        " job_name='worker', task_index=0).join()"), json.dumps(cluster)])
    try:
      resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
          tf.train.ClusterSpec(cluster), rpc_layer="grpc")
      tf.config.experimental_connect_to_cluster(
          resolver, job_name="chief", task_index=0,
          make_master_device_default=False)
      with tf.device("/job:worker/task:0/device:CPU:0"):
        weight = tf.Variable(tf.ones([4]))
      manager = CheckpointManager(tf.train.Checkpoint(weight=weight),
                                  model_dir, tf.distribute.get_strategy())
      manager.save(1)
      worker.send_signal(signal.SIGKILL)
      worker.wait()
      try:
        manager.save(2)
        print("OUTCOME saved")
      except ModelDirError as e:
        print("OUTCOME ModelDirError", e)
      except tf.errors.OpError as e:
        print("OUTCOME", type(e).__name__)
    finally:
      worker.kill()
""")


@pytest.mark.slow
def test_saving_variables_of_a_dead_task_raises_the_transport_error(
    tmp_path):
  model_dir = tmp_path / "run"
  proc = helpers.run_code(CHIEF, str(model_dir), timeout=300)
  outcome = [l for l in proc.stdout.splitlines() if l.startswith("OUTCOME")]
  assert outcome, proc.stdout[-2000:] + proc.stderr[-3000:]
  # train.py turns this into "a task of the cluster failed ... relaunch";
  # a ModelDirError would blame the model_dir instead.
  assert outcome[0] in ("OUTCOME UnavailableError",
                        "OUTCOME AbortedError",
                        "OUTCOME CancelledError",
                        "OUTCOME DeadlineExceededError"), outcome
  # The first checkpoint is intact, the second was never written.
  names = sorted(os.listdir(model_dir))
  assert "ckpt-1.index" in names and not any(
      n.startswith("ckpt-2") for n in names), names
