"""Every strategy from one name, and clear errors for bad cluster specs."""

import json

import pytest
import tensorflow as tf

import framework
import framework.distribute.strategies  # noqa: F401  (the attribute chain below)
import framework.distribute.tf_config  # noqa: F401  (the attribute chain below)
from framework.distribute import strategies


@pytest.mark.parametrize("name,replicas", [("default", 1), ("one_device", 1),
                                           ("mirrored", 2),
                                           ("central_storage", 2)])
def test_local_strategies(name, replicas):
  strategy = framework.make_strategy(name)
  assert strategy.num_replicas_in_sync == replicas
  assert framework.distribute.strategies.is_chief(strategy)
  assert framework.make_strategy(name) is strategy  # one per process


def test_mirrored_uses_the_logical_cpu_devices():
  devices = framework.make_strategy("mirrored").extended.worker_devices
  assert [d.split("/")[-1] for d in devices] == ["device:CPU:0",
                                                  "device:CPU:1"]


def test_unknown_strategy_lists_the_known_ones():
  with pytest.raises(framework.ConfigError, match="strategy='nccl'.*mirrored"):
    framework.make_strategy("nccl")


@pytest.mark.parametrize("name", ["multi_worker_mirrored", "parameter_server"])
def test_cluster_strategies_need_tf_config(monkeypatch, name):
  monkeypatch.delenv("TF_CONFIG", raising=False)
  with pytest.raises(framework.ConfigError, match="needs TF_CONFIG"):
    framework.make_strategy(name)


def cluster(**roles):
  return {role: [f"127.0.0.1:{2000 + 10 * i + j}" for j in range(n)]
          for i, (role, n) in enumerate(roles.items())}


@pytest.mark.parametrize("config,match", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    (json.dumps({"task": {"type": "worker", "index": 0}}), "'cluster'"),
    (json.dumps({"cluster": {"boss": ["a:1"]}, "task": {"type": "boss"}}),
     "role 'boss' is unknown"),
    (json.dumps({"cluster": cluster(worker=2), "task": {"type": "worker",
                                                        "index": 2}}),
     r"task.index=2 is out of range for cluster.worker with 2"),
    (json.dumps({"cluster": dict(cluster(worker=1), chief=["a:1", "b:2"]),
                 "task": {"type": "worker", "index": 0}}),
     "at most one chief"),
    (json.dumps({"cluster": {"worker": ["127.0.0.1"]},
                 "task": {"type": "worker", "index": 0}}),
     r"cluster.worker\[0\]='127.0.0.1' is not 'host:port'"),
    (json.dumps({"cluster": cluster(worker=1), "task": {"type": "ps"}}),
     "task.type='ps' is not a role"),
])
def test_malformed_tf_config_names_the_field(config, match):
  with pytest.raises(framework.ConfigError, match=match):
    framework.distribute.tf_config.parse_tf_config(config)


def test_valid_tf_config_parses_and_unset_is_none():
  config = {"cluster": cluster(chief=1, worker=2, ps=1),
            "task": {"type": "worker", "index": 1}}
  assert framework.distribute.tf_config.parse_tf_config(json.dumps(config)) == config
  assert framework.distribute.tf_config.parse_tf_config("") is None


def test_parameter_server_needs_ps_tasks(monkeypatch):
  monkeypatch.setenv("TF_CONFIG", json.dumps(
      {"cluster": cluster(worker=2), "task": {"type": "worker", "index": 0}}))
  with pytest.raises(framework.ConfigError, match="needs 'ps' tasks"):
    framework.make_strategy("parameter_server")


def test_tpu_needs_a_name():
  with pytest.raises(framework.ConfigError, match="strategy=tpu needs tpu="):
    framework.make_strategy("tpu", tpu=None)


def test_tpu_resolver_is_built_from_the_flag():
  # Everything up to contacting the TPU: the resolver points at the address.
  resolver = strategies.tpu_cluster_resolver("grpc://127.0.0.1:8470")
  assert resolver.master() == "grpc://127.0.0.1:8470"


def test_cpu_devices_after_initialisation_is_a_clear_error():
  assert len(tf.config.list_logical_devices("CPU")) == 2
  framework.configure_cpu_devices(2)  # what is already there: fine
  with pytest.raises(framework.ConfigError, match="cpu_devices=4"):
    framework.configure_cpu_devices(4)
  with pytest.raises(framework.ConfigError, match="cpu_devices=0"):
    framework.configure_cpu_devices(0)
