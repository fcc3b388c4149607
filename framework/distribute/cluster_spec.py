"""The cluster a job runs on: `{role: ["host:port", ...]}` and TF_CONFIG.

    local_cluster(workers=2, ps=1)   # chief, 2 workers, 1 ps on loopback
    cluster_on_hosts(["10.0.0.1", "10.0.0.2"], workers=2)
    tf_config(cluster, "worker", 0)  # that task's TF_CONFIG text

TensorFlow-free, like the launcher that uses it.
"""

import functools
import json
import random
import socket

from framework.distribute.config import LaunchConfig
from framework.errors import ConfigError, check_positive
from framework.settings import default

ROLE_ORDER = ("chief", "worker", "ps", "evaluator")
# The keyword defaults of the launch settings: `LaunchConfig`'s, declared once.
_default = functools.partial(default, LaunchConfig)


def _ephemeral_port_range():
  try:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
      low, high = (int(x) for x in f.read().split())
    return low, high
  except (OSError, ValueError):
    return None


def free_ports(count, host=_default("host")):
  """`count` distinct TCP ports on `host` that are free right now.

  Ports come from below the kernel's ephemeral range where there is room:
  a task needs a few seconds to import TensorFlow before it binds its port,
  and meanwhile a port from the ephemeral range can be taken by any
  process's outgoing connection (the gRPC channels of the tasks themselves).
  """
  ephemeral = _ephemeral_port_range()
  if ephemeral and ephemeral[0] > 12000:
    candidates = random.Random().sample(range(10000, ephemeral[0]),
                                        min(ephemeral[0] - 10000, 200))
    ports = [p for p in candidates if _bindable(host, p)][:count]
    if len(ports) == count:
      return ports
  sockets = []
  try:
    for _ in range(count):
      s = socket.socket()
      s.bind((host, 0))
      sockets.append(s)
    return [s.getsockname()[1] for s in sockets]
  finally:
    for s in sockets:
      s.close()


def _bindable(host, port):
  with socket.socket() as s:
    try:
      s.bind((host, port))
      return True
    except OSError:
      return False


def _task_counts(workers, ps, chief):
  """{role: count}; a chief by default only beside parameter servers."""
  chief = ps > 0 if chief is None else chief
  return {"chief": int(chief), "worker": workers, "ps": ps}


def cluster_on_hosts(hosts, workers, ps=_default("ps"), *,
                     chief=_default("chief"), port=2222):
  """Like `local_cluster`, with one address of `hosts` per task (in
  `tasks_of` order) and the same `port` on each."""
  counts = _task_counts(workers, ps, chief)
  if sum(counts.values()) > len(hosts):
    raise ConfigError(f"{sum(counts.values())} tasks need as many hosts; "
                      f"got {len(hosts)}")
  addresses = iter(f"{h}:{port}" for h in hosts)
  return {role: [next(addresses) for _ in range(n)]
          for role, n in counts.items() if n}


def local_cluster(workers, ps=_default("ps"), *, chief=_default("chief"),
                  host=_default("host")):
  """A cluster dict {role: ['host:port', ...]} on free loopback ports.

  Args:
    workers: number of `worker` tasks.
    ps: number of parameter-server tasks; with `ps > 0` there is also a
      `chief` (the ParameterServerStrategy coordinator).
    chief: add a chief task (default: only when `ps > 0`).
  """
  check_positive("workers", workers)
  if isinstance(ps, bool) or not isinstance(ps, int) or ps < 0:
    raise ConfigError(f"ps={ps!r} must be an integer >= 0")
  counts = _task_counts(workers, ps, chief)
  ports = iter(free_ports(sum(counts.values()), host))
  return {role: [f"{host}:{next(ports)}" for _ in range(n)]
          for role, n in counts.items() if n}


def tf_config(cluster, task_type, index):
  """The TF_CONFIG JSON text for task `task_type:index` of `cluster`."""
  return json.dumps({"cluster": cluster,
                     "task": {"type": task_type, "index": index}})


def tasks_of(cluster):
  """[(role, index)] in a stable order: chief, workers, ps, evaluator."""
  roles = sorted(cluster, key=lambda r: (ROLE_ORDER.index(r)
                                         if r in ROLE_ORDER else 99, r))
  return [(role, i) for role in roles for i in range(len(cluster[role]))]
