"""TF_CONFIG: parsing and validation, without TensorFlow.

A bad cluster description must fail in seconds with the field named, instead
of hanging in gRPC. This module imports nothing heavy, so that scripts can
check TF_CONFIG before paying for TensorFlow's import.
"""

import json
import os

from framework.errors import ConfigError

_CLUSTER_ROLES = ("chief", "worker", "ps", "evaluator")


def _check_address(where, address):
  host, sep, port = str(address).rpartition(":")
  if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise ConfigError(
        f"TF_CONFIG {where}={address!r} is not 'host:port' with a port in "
        "1..65535")


def parse_tf_config(text=None):
  """Parses and validates TF_CONFIG (default: the environment variable).

  Returns:
    The decoded dict, or None when TF_CONFIG is unset or empty.
  Raises:
    ConfigError naming the malformed field.
  """
  text = os.environ.get("TF_CONFIG", "") if text is None else text
  if not text.strip():
    return None
  try:
    config = json.loads(text)
  except json.JSONDecodeError as e:
    raise ConfigError(f"TF_CONFIG is not valid JSON ({e})") from None
  if not isinstance(config, dict):
    raise ConfigError("TF_CONFIG must be a JSON object with 'cluster' and "
                      "'task'")
  cluster, task = config.get("cluster"), config.get("task")
  if not isinstance(cluster, dict) or not cluster:
    raise ConfigError("TF_CONFIG 'cluster' must be a non-empty object mapping "
                      f"roles ({', '.join(_CLUSTER_ROLES)}) to address lists")
  for role, addresses in cluster.items():
    if role not in _CLUSTER_ROLES:
      raise ConfigError(f"TF_CONFIG cluster role {role!r} is unknown; valid "
                        f"roles: {', '.join(_CLUSTER_ROLES)}")
    if not isinstance(addresses, list) or not addresses:
      raise ConfigError(f"TF_CONFIG cluster.{role} must be a non-empty list "
                        "of 'host:port' addresses")
    for i, address in enumerate(addresses):
      _check_address(f"cluster.{role}[{i}]", address)
  seen = {}
  for role, addresses in cluster.items():
    for i, address in enumerate(addresses):
      where = f"cluster.{role}[{i}]"
      if address in seen:
        # Two tasks cannot listen on one port: the cluster would wait out
        # its whole start-up timeout for a task that never comes up.
        raise ConfigError(f"TF_CONFIG {where} and {seen[address]} are both "
                          f"{address!r}; every task needs its own "
                          "host:port")
      seen[address] = where
  if len(cluster.get("chief", [])) > 1:
    raise ConfigError(f"TF_CONFIG cluster.chief lists {len(cluster['chief'])} "
                      "addresses; a cluster has at most one chief")
  if not isinstance(task, dict):
    raise ConfigError("TF_CONFIG 'task' must be an object with 'type' and "
                      "'index'")
  task_type, index = task.get("type"), task.get("index", 0)
  if task_type not in cluster:
    raise ConfigError(f"TF_CONFIG task.type={task_type!r} is not a role of "
                      f"the cluster ({', '.join(cluster)})")
  if isinstance(index, bool) or not isinstance(index, int) or not (
      0 <= index < len(cluster[task_type])):
    raise ConfigError(f"TF_CONFIG task.index={index!r} is out of range for "
                      f"cluster.{task_type} with {len(cluster[task_type])} "
                      "task(s)")
  return config


def require_tf_config(name, needs_ps):
  """The validated TF_CONFIG that strategy `name` needs (ConfigError if not)."""
  config = parse_tf_config()
  if config is None:
    raise ConfigError(
        f"strategy={name} needs TF_CONFIG describing the cluster (see docs/guide/distributed.md "
        "or scripts/launch.py); it is not set")
  has_ps = "ps" in config["cluster"]
  if needs_ps and not has_ps:
    raise ConfigError(f"strategy={name} needs 'ps' tasks in TF_CONFIG "
                      "cluster")
  if not needs_ps and has_ps:
    raise ConfigError(f"strategy={name} does not use 'ps' tasks; TF_CONFIG "
                      "lists some (use strategy=parameter_server)")
  return config
