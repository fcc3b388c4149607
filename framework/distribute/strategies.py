"""Builds every `tf.distribute` strategy from one name.

`make_strategy("mirrored")` is the only place that knows how each strategy is
constructed; everything else in distloop takes the strategy object. Cluster
strategies read TF_CONFIG, which is validated first (framework.distribute.tf_config) so
that a bad cluster description fails in seconds with the field named, instead
of hanging in gRPC.
"""

import os
from typing import Optional

import tensorflow as tf

from framework.distribute import cluster
from framework.distribute.config import STRATEGIES
from framework.distribute.tf_config import parse_tf_config, require_tf_config
from framework.errors import ConfigError, check_choice, check_positive


def configure_cpu_devices(num_devices: int) -> None:
  """Splits the host CPU into `num_devices` logical devices.

  Must run before TensorFlow initialises its devices (before any op runs or
  strategy is created); afterwards it raises ConfigError.
  """
  check_positive("cpu_devices", num_devices)
  cpu = tf.config.list_physical_devices("CPU")[0]
  config = [tf.config.LogicalDeviceConfiguration()] * num_devices
  try:
    tf.config.set_logical_device_configuration(cpu, config)
  except RuntimeError as e:
    current = len(tf.config.list_logical_devices("CPU"))
    if current == num_devices:
      return
    raise ConfigError(
        f"cpu_devices={num_devices}: TensorFlow is already initialised with "
        f"{current} CPU device(s); set it before any TensorFlow op runs") from e


def tpu_cluster_resolver(tpu):
  """The TPUClusterResolver for `tpu` (a name, or a 'grpc://host:port')."""
  if not tpu:
    raise ConfigError("strategy=tpu needs tpu= (a TPU name, 'local', or "
                      "'grpc://host:port')")
  return tf.distribute.cluster_resolver.TPUClusterResolver(tpu=tpu)


_LOCAL_STRATEGIES = {}


def make_strategy(name: str, *,
                  tpu: Optional[str] = None) -> tf.distribute.Strategy:
  """Returns the `tf.distribute.Strategy` called `name`.

  Local strategies are created once per process and reused: two
  MirroredStrategy objects in one process hand out the same collective
  instance keys and corrupt each other's all-reduces.

  Args:
    name: one of STRATEGIES. `mirrored` and `central_storage` use every GPU,
      or every logical CPU device when there is no GPU (see
      `configure_cpu_devices`).
    tpu: the TPU to connect to, for `name="tpu"`.
  """
  check_choice("strategy", name, STRATEGIES)
  if not os.environ.get("TF_CONFIG", "x").strip():
    # TensorFlow's resolvers fail on an empty TF_CONFIG: it means unset.
    del os.environ["TF_CONFIG"]
  parse_tf_config()  # even local strategies read it; fail clearly first
  # Cluster strategies first: listing devices initialises TensorFlow, after
  # which collective ops can no longer be configured.
  if name == "multi_worker_mirrored":
    cluster.configure_coordination_service(
        require_tf_config(name, needs_ps=False))
    return tf.distribute.MultiWorkerMirroredStrategy(
        cluster_resolver=tf.distribute.cluster_resolver.TFConfigClusterResolver())
  if name == "parameter_server":
    require_tf_config(name, needs_ps=True)
    return tf.distribute.experimental.ParameterServerStrategy(
        tf.distribute.cluster_resolver.TFConfigClusterResolver())
  gpus = tf.config.list_logical_devices("GPU")
  local = [d.name for d in (gpus or tf.config.list_logical_devices("CPU"))]
  if name == "default":
    return tf.distribute.get_strategy()
  if name in ("one_device", "mirrored", "central_storage"):
    key = (name, tuple(local))
    if key not in _LOCAL_STRATEGIES:
      _LOCAL_STRATEGIES[key] = _make_local(name, local)
    return _LOCAL_STRATEGIES[key]
  resolver = tpu_cluster_resolver(tpu)
  tf.config.experimental_connect_to_cluster(resolver)
  tf.tpu.experimental.initialize_tpu_system(resolver)
  return tf.distribute.TPUStrategy(resolver)


def _make_local(name, devices):
  if name == "one_device":
    return tf.distribute.OneDeviceStrategy(devices[0])
  if name == "mirrored":
    return tf.distribute.MirroredStrategy(devices)
  return tf.distribute.experimental.CentralStorageStrategy(
      compute_devices=devices, parameter_device="/cpu:0")


def task_info(strategy):
  """(task_type, task_id) of this process; (None, 0) for local strategies."""
  resolver = getattr(strategy, "cluster_resolver", None)
  if resolver is None or not resolver.cluster_spec().as_dict():
    return None, 0
  return resolver.task_type, resolver.task_id or 0


def is_chief(strategy):
  """Whether this process writes summaries and the real checkpoints."""
  task_type, task_id = task_info(strategy)
  if task_type is None or task_type == "chief":
    return True
  cluster = strategy.cluster_resolver.cluster_spec().as_dict()
  return task_type == "worker" and task_id == 0 and "chief" not in cluster


def chief_value(strategy, value: int) -> int:
  """The chief's `value` (an int, |value| < 2**53) on every worker of a
  MultiWorkerMirroredStrategy, `value` itself under any other strategy.

  A collective: every worker calls it at the same point, and none returns
  before the chief has called it (what the chief wrote before is there).
  """
  if (not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
      or task_info(strategy)[0] is None):
    return value
  # Only the chief's first replica (replica 0 of the group) adds its value.
  mine = tf.constant(value if is_chief(strategy) else 0, tf.float64)

  @tf.function
  def agree():
    def replica_fn():
      context = tf.distribute.get_replica_context()
      first = tf.equal(context.replica_id_in_sync_group, 0)
      return context.all_reduce(tf.distribute.ReduceOp.SUM,
                                tf.where(first, mine, tf.zeros_like(mine)))
    return strategy.run(replica_fn)

  return int(strategy.experimental_local_results(agree())[0].numpy())
