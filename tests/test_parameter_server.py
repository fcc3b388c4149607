"""ParameterServerStrategy: a coordinator, 2 workers and 1 ps on 127.0.0.1."""

import glob
import os
import time

import pytest
import tensorflow as tf

from framework import launcher
from tests import cluster_utils as cu

PS = cu.MLP + ["--strategy=parameter_server", "--steps_per_loop=20",
               "--log_every=20", "--summary_every=20"]


def _scalars(logdir, tag):
  """[(step, value)] of scalar `tag` in the event files under `logdir`."""
  values = []
  for path in glob.glob(os.path.join(logdir, "events.*")):
    for event in tf.compat.v1.train.summary_iterator(path):
      for value in event.summary.value:
        if value.tag == tag:
          values.append((event.step, float(tf.make_ndarray(value.tensor))))
  return sorted(values)


@pytest.mark.slow
def test_coordinator_trains_to_the_requested_step(tmp_path):
  model_dir = str(tmp_path / "run")
  proc = cu.launch(PS + ["--train_steps=60", "--checkpoint_every=20",
                         f"--model_dir={model_dir}"], workers=2, ps=1)
  assert proc.returncode == 0, proc.stdout[-4000:]
  # The step counter is a variable on the ps: exactly the requested steps.
  assert cu.global_step(model_dir) == 60
  assert cu.checkpoint_step(model_dir) == 60
  # Trainer.apply_gradients under PS: one optimizer update per step.
  reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(model_dir))
  assert reader.get_tensor(
      "optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE") == 60
  # Metrics and summaries come from the coordinator.
  losses = _scalars(os.path.join(model_dir, "train"), "loss")
  assert [step for step, _ in losses] == [20, 40, 60]
  assert losses[-1][1] <= losses[0][1] / 2, losses
  assert "[chief:0]" in proc.stdout and "train step 60/60" in proc.stdout
  assert cu.pids_alive(cu.launched_pids(proc.stdout)) == []


@pytest.mark.slow
def test_worker_restart_is_survived_and_a_lost_ps_is_a_clear_error(tmp_path):
  model_dir = str(tmp_path / "run")
  cluster = launcher.local_cluster(2, ps=1)

  def start(role, index, steps, name):
    return cu.start_task(
        cluster, role, index, PS + [f"--train_steps={steps}",
                                    "--checkpoint_every=100",
                                    f"--model_dir={model_dir}"],
        str(tmp_path / f"{name}.log"))

  servers = {("ps", 0): start("ps", 0, 1, "ps"),
             ("worker", 0): start("worker", 0, 1, "worker0"),
             ("worker", 1): start("worker", 1, 1, "worker1")}
  try:
    # The fault below is the only one this test means to inject: start the
    # coordinator once the servers serve, not while they are still starting.
    cu.wait_listening(cluster, ["ps", "worker"], list(servers.values()))
    # 1. SIGKILL worker 1 mid-run, restart it 2 s later: every step is done.
    chief = start("chief", 0, 600, "chief1")
    cu.wait_for_checkpoint(model_dir, 100, [chief] + list(servers.values()))
    servers[("worker", 1)].kill()
    servers[("worker", 1)].wait()
    time.sleep(2)
    servers[("worker", 1)] = start("worker", 1, 1, "worker1_restarted")
    assert cu.wait_exit(chief, timeout=900) == 0, cu.log_tail(chief)
    assert cu.global_step(model_dir) == 600

    # 2. A new coordinator resumes; SIGKILL the ps: it fails with one line
    # (the time it takes is printed, not asserted; the timeout stops a hang).
    chief = start("chief", 0, 100000, "chief2")
    saved = cu.wait_for_checkpoint(model_dir, 700, [chief])
    servers[("ps", 0)].kill()
    start_time = time.monotonic()
    code = cu.wait_exit(chief, timeout=600)
    seconds = time.monotonic() - start_time
    log = open(tmp_path / "chief2.log").read()
    assert f"Restored checkpoint {model_dir}/ckpt-600" in log
    assert code == 1, log[-3000:]
    print(f"the coordinator exited {seconds:.1f}s after the ps was killed")
    [line] = cu.error_lines(log)
    assert line.startswith("train.py: error: a task of the cluster failed")
    assert f"ps:0 ({cluster['ps'][0]})" in line
  finally:
    cu.stop_all(list(servers.values()))

  # 3. Relaunching the whole job resumes from the last checkpoint.
  last = cu.checkpoint_step(model_dir)
  assert last >= saved
  proc = cu.launch(PS + [f"--train_steps={last + 40}",
                         "--checkpoint_every=100", f"--model_dir={model_dir}"],
                   workers=2, ps=1)
  assert proc.returncode == 0, proc.stdout[-4000:]
  assert f"Restored checkpoint {model_dir}/ckpt-{last}" in proc.stdout
  assert cu.global_step(model_dir) == last + 40
