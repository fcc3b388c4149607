"""The local launcher: TF_CONFIG per task, prefixed output, exit status, cleanup.

The tasks here are small Python programs (no TensorFlow), so that the
launcher's own behaviour is tested quickly; the training tests in
test_multi_worker.py and test_parameter_server.py launch train.py.
"""

import json
import re
import socket
import subprocess
import sys

import pytest

from framework.distribute import cluster_spec, launcher
from framework.distribute import netns
from framework.errors import ConfigError
from tests import cluster_utils as cu

# Prints its task, then: worker 1 fails with status 3 after a moment; every
# other task ignores SIGTERM and sleeps, so the launcher must SIGKILL it.
TASK = r"""
import json, os, signal, sys, time
config = json.loads(os.environ["TF_CONFIG"])
task = config["task"]
print("task", task["type"], task["index"], sorted(config["cluster"]), flush=True)
if task["type"] == os.environ["FAIL_ROLE"] and task["index"] == 1:
  time.sleep(1.0)
  sys.exit(int(os.environ["FAIL_STATUS"]))
if task["type"] == "chief":
  time.sleep(1.0)
  sys.exit(0)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
time.sleep(120)
"""


def _launch(*flags, env=None):
  return subprocess.run(
      cu.LAUNCH + list(flags) + ["--grace_period=1", "--", sys.executable,
                                 "-c", TASK],
      cwd=cu.ROOT, env=dict(cu.ENV, **(env or {})), capture_output=True,
      text=True, timeout=60)


def test_local_cluster_addresses_are_distinct_loopback_ports():
  cluster = launcher.local_cluster(2, ps=1)
  assert sorted(cluster) == ["chief", "ps", "worker"]
  addresses = [a for role in cluster.values() for a in role]
  assert len(set(addresses)) == 4
  assert all(a.startswith("127.0.0.1:") for a in addresses)
  config = json.loads(launcher.tf_config(cluster, "worker", 1))
  assert config["task"] == {"type": "worker", "index": 1}
  assert launcher.tasks_of(cluster)[0] == ("chief", 0)


@pytest.mark.slow
def test_the_launcher_starts_no_tensorflow():
  # framework/__init__.py imports lazily: the launcher process stays light.
  code = ("import sys, framework, framework.distribute.launcher; "
          "assert 'tensorflow' not in sys.modules; "
          "framework.Trainer; assert 'tensorflow' in sys.modules")
  subprocess.run([sys.executable, "-c", code], cwd=cu.ROOT, check=True)


def test_free_ports_are_bindable_and_outside_the_ephemeral_range():
  ports = launcher.free_ports(6)
  assert len(set(ports)) == 6
  ephemeral = cluster_spec._ephemeral_port_range()  # pylint: disable=protected-access
  if ephemeral and ephemeral[0] > 12000:
    # Outgoing connections take ephemeral ports; a task's port must not be
    # one of them while the task is still importing TensorFlow.
    assert all(p < ephemeral[0] for p in ports), (ports, ephemeral)
  for port in ports:
    with socket.socket() as s:
      s.bind(("127.0.0.1", port))


def test_first_failure_is_the_exit_status_and_no_task_survives():
  proc = _launch("--workers=3", env={"FAIL_ROLE": "worker",
                                     "FAIL_STATUS": "3"})
  assert proc.returncode == 3, proc.stdout + proc.stderr
  for index in range(3):
    assert f"[worker:{index}] task worker {index} ['worker']" in proc.stdout
  assert "[launch] worker:1 exited with status 3" in proc.stdout
  pids = cu.launched_pids(proc.stdout)
  assert len(pids) == 3
  # Workers 0 and 2 ignored SIGTERM: they were SIGKILLed after the grace.
  assert cu.pids_alive(pids) == []


@pytest.mark.slow
def test_parameter_server_job_ends_when_the_chief_finishes():
  # ps and workers only serve; the chief (coordinator) decides the end.
  proc = _launch("--workers=2", "--ps=1", env={"FAIL_ROLE": "none",
                                               "FAIL_STATUS": "0"})
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert "[chief:0] task chief 0 ['chief', 'ps', 'worker']" in proc.stdout
  assert "[ps:0] task ps 0" in proc.stdout
  pids = cu.launched_pids(proc.stdout)
  assert len(pids) == 4
  assert cu.pids_alive(pids) == []


def test_launcher_without_command_is_one_error_line():
  proc = subprocess.run(cu.LAUNCH + ["--workers=2"], cwd=cu.ROOT, env=cu.ENV,
                        capture_output=True, text=True, timeout=60)
  assert proc.returncode == 1
  assert cu.error_lines(proc.stderr) == [
      "launch.py: error: no command to launch: put it after '--', e.g. "
      "launch.py --workers=2 -- python scripts/train.py ..."]


def test_slurm_tasks_become_a_tf_config(monkeypatch):
  from framework.distribute import cluster  # pylint: disable=g-import-not-at-top
  # Task 2 of 4, two per node, as srun sets it.
  monkeypatch.setenv("SLURM_PROCID", "2")
  monkeypatch.setenv("SLURM_STEP_NODELIST", "node[01-02]")
  monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "2(x2)")
  monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "4")
  monkeypatch.setattr(cluster.shutil, "which", lambda name: None)
  assert cluster.tf_config_from_slurm(port_base=9000) == {
      "cluster": {"worker": ["node01:9000", "node01:9001", "node02:9000",
                             "node02:9001"]},
      "task": {"type": "worker", "index": 2}}
  config = cluster.tf_config_from_slurm(ps_tasks=1)
  assert sorted(config["cluster"]) == ["chief", "ps", "worker"]
  assert len(config["cluster"]["worker"]) == 2


# Worker 1 kills itself (SIGKILL, as `kill -9`) in its first KILLS attempts,
# counted in the file ATTEMPTS; worker 0 waits for worker 1 to succeed.
RESTART_TASK = r"""
import json, os, signal, sys, time
task = json.loads(os.environ["TF_CONFIG"])["task"]
attempts, done = os.environ["ATTEMPTS"], os.environ["ATTEMPTS"] + ".done"
if task["index"] == 1:
  with open(attempts, "a") as f:
    f.write("attempt\n")
  if len(open(attempts).read().split()) <= int(os.environ["KILLS"]):
    time.sleep(0.3)
    os.kill(os.getpid(), signal.SIGKILL)
  open(done, "w").close()
  sys.exit(0)
deadline = time.time() + 60
while not os.path.exists(done) and time.time() < deadline:
  time.sleep(0.05)
sys.exit(0 if os.path.exists(done) else 5)
"""


@pytest.mark.parametrize("kills", [2, 3])
def test_max_restarts_starts_the_whole_job_again_then_gives_up(kills,
                                                               tmp_path):
  proc = subprocess.run(
      cu.LAUNCH + ["--workers=2", "--max_restarts=2", "--grace_period=1",
                   "--", sys.executable, "-c", RESTART_TASK],
      cwd=cu.ROOT, env=dict(cu.ENV, ATTEMPTS=str(tmp_path / "attempts"),
                            KILLS=str(kills)),
      capture_output=True, text=True, timeout=120)
  output = proc.stdout + proc.stderr
  restarts = re.findall(r"^\[launch\] restart (\d) of 2 after worker:1 "
                        r"exited with status 137: ", proc.stdout, re.M)
  assert restarts == ["1", "2"], output
  pids = cu.launched_pids(proc.stdout)
  assert len(set(pids)) == 6, output  # 3 attempts x 2 tasks
  assert cu.pids_alive(pids) == []
  # Each attempt gets fresh ports: a killed task's port may still be held.
  ports = re.findall(r"^\[launch\] worker:\d pid=\d+ address=(\S+)$",
                     proc.stdout, re.M)
  assert len(ports) == 6 and len(set(ports)) >= 3, ports
  if kills == 2:
    assert proc.returncode == 0, output
    assert cu.error_lines(proc.stderr) == []
  else:
    assert proc.returncode == 137, output
    assert cu.error_lines(proc.stderr) == [
        "launch.py: error: worker:1 exited with status 137 after 2 "
        "restart(s) (--max_restarts=2); giving up"], output


# Binds its own address from TF_CONFIG, which exists only on its own host,
# and fails to bind the other task's.
NETNS_TASK = r"""
import json, os, socket
config = json.loads(os.environ["TF_CONFIG"])
mine = config["cluster"]["worker"][config["task"]["index"]]
other = config["cluster"]["worker"][1 - config["task"]["index"]]
socket.socket().bind((mine.split(":")[0], 0))
try:
  socket.socket().bind((other.split(":")[0], 0))
  print("bound the other host's address", flush=True)
except OSError:
  print("own host", mine, flush=True)
for name in os.listdir("/sys/class/net"):
  if name != "lo":
    with open(f"/sys/class/net/{name}/mtu") as f:
      print("mtu", f.read().strip(), flush=True)
"""


@pytest.mark.skipif(netns.missing() is not None,
                    reason=f"no network namespaces: {netns.missing()}")
def test_netns_puts_each_task_on_its_own_host():
  job = subprocess.Popen(
      cu.LAUNCH + ["--workers=2", "--netns", "--netns_rate=1gbit",
                   "--netns_mtu=9000", "--",
                   sys.executable, "-c", NETNS_TASK],
      cwd=cu.ROOT, env=cu.ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
      text=True)
  stdout, stderr = job.communicate(timeout=120)
  assert job.returncode == 0, stdout + stderr
  lines = sorted(re.findall(r"^\[worker:\d\] own host (\S+)$", stdout, re.M))
  assert lines == ["10.77.0.1:2223", "10.77.0.2:2223"], stdout
  assert re.findall(r"^\[worker:\d\] mtu (\d+)$", stdout, re.M) == [
      "9000", "9000"], stdout
  # The namespaces went with the job.
  left = subprocess.run(["ip", "netns", "list"], capture_output=True,
                        text=True, check=True).stdout
  assert f"dl{job.pid % 100000}-" not in left, left


def test_netns_flags_without_netns_are_one_line():
  for flag, value in (("--netns_rate", "1gbit"), ("--netns_mtu", "9000")):
    proc = subprocess.run(
        cu.LAUNCH + ["--workers=2", f"{flag}={value}", "--", sys.executable,
                     "-c", "pass"],
        cwd=cu.ROOT, env=cu.ENV, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip() == (
        f"launch.py: error: {flag[2:]}={value!r} needs --netns"
        if flag == "--netns_rate" else
        f"launch.py: error: {flag[2:]}={value} needs --netns"), proc.stderr


def test_host_network_checks_its_mtu():
  with pytest.raises(ConfigError, match=r"mtu=100 must be an integer in "
                     r"576..65535"):
    netns.HostNetwork(2, mtu=100)
