"""Which devices model-parallel pieces go on, and short names for them.

Local (the default): stage or shard `i` goes on `/GPU:i` when there are
enough GPUs, else on the logical CPU device `/CPU:i` (split the host with
`framework.configure_cpu_devices(n)`).

Cluster: stage or shard `i` goes on `/job:worker/task:i` of the TF_CONFIG
cluster. The chief runs the training loop and reaches the workers through
TensorFlow's distributed runtime (`connect_cluster`); each worker only runs
a `tf.distribute.Server`.
"""

import os

import keras
import tensorflow as tf

from framework.errors import ConfigError, check_positive
from framework.model_parallel.choices import PLACEMENTS  # pylint: disable=unused-import


def model_parallel_devices(count, *, name="num_stages"):
  """The first `count` GPUs, else the first `count` logical CPU devices.

  GPUs are used when there are at least `count` of them; otherwise the
  host's logical CPU devices (e.g. tests on a one-GPU machine).

  Args:
    count: how many devices the split needs.
    name: the argument that asked for them (named in the error).
  Raises:
    ConfigError: fewer than `count` devices of either kind exist.
  """
  check_positive(name, count)
  gpus = len(tf.config.list_logical_devices("GPU"))
  cpus = len(tf.config.list_logical_devices("CPU"))
  if gpus >= count:
    return [f"/GPU:{i}" for i in range(count)]
  if cpus >= count:
    return [f"/CPU:{i}" for i in range(count)]
  raise ConfigError(
      f"{name}={count} needs {count} devices but only {cpus} CPU device(s) "
      f"and {gpus} GPU(s) exist; split the CPU with --cpu_devices={count} "
      "(or use fewer)")


def check_cluster(tf_config, count, *, name="num_stages", per="piece"):
  """Raises ConfigError unless `tf_config` has a chief and `count` workers.

  Args:
    tf_config: the parsed TF_CONFIG (None: unset).
    count: stages or shards (or a mesh's copies), one per worker task.
    name: the argument that sets `count`; per: what one task holds.
  """
  if tf_config is None:
    raise ConfigError(
        "model_parallel_devices=cluster needs TF_CONFIG describing a chief "
        f"and {count} worker tasks; it is not set (start the job with "
        f"scripts/launch.py --workers={count} -- ...)")
  cluster = tf_config["cluster"]
  workers = len(cluster.get("worker", []))
  if "chief" not in cluster:
    raise ConfigError(
        "model_parallel_devices=cluster needs a chief task (it runs the "
        "training loop); TF_CONFIG has none (scripts/launch.py adds one)")
  if workers < count:
    raise ConfigError(
        f"model_parallel_devices=cluster with {name}={count} needs {count} "
        f"worker tasks (one per {per}); TF_CONFIG has {workers}")


def connect_cluster(tf_config):
  """Connects this chief to the cluster's tasks (their devices appear).

  Ops without a device scope stay on the chief.
  """
  resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
      tf.train.ClusterSpec(tf_config["cluster"]), task_type="chief",
      task_id=0, rpc_layer="grpc")
  tf.config.experimental_connect_to_cluster(
      resolver, job_name="chief", task_index=0,
      make_master_device_default=False)


def start_cluster(config, tf_config=None):
  """This task's part of a `devices=cluster` split (`ModelParallelConfig`).

  A worker serves the chief until it is stopped, then returns None; the
  chief connects to the workers and returns the TF_CONFIG dict.

  Raises:
    ConfigError: no TF_CONFIG, no chief, too few workers, or a task type
      other than chief and worker.
  """
  # pylint: disable-next=g-import-not-at-top
  from framework.distribute import cluster, tf_config as tf_config_lib
  tf_config = tf_config or tf_config_lib.parse_tf_config()
  count, name = config.device_count
  per = "piece"
  if config.mesh:  # a copy of the split per task (mesh_cluster)
    count, name, per = config.data_axis, f"mesh={config.mesh}: data", "copy"
  check_cluster(tf_config, count, name=name, per=per)
  # A call to a dead worker fails at once instead of retrying forever.
  os.environ.setdefault("GRPC_FAIL_FAST", "use_caller")
  task_type = tf_config["task"]["type"]
  if task_type == "worker":
    # The server offers the logical CPU devices of --cpu_devices (a mesh's
    # copy needs several); it does not read tf.config's.
    cpus = tf.config.get_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0])
    cluster.run_server(tf_config, cpu_devices=len(cpus) if cpus else None)
    return None
  if task_type != "chief":
    raise ConfigError(
        f"model_parallel_devices=cluster runs a chief and workers; this "
        f"task is {task_type!r}")
  connect_cluster(tf_config)
  return tf_config


def cluster_devices(count):
  """`/job:worker/replica:0/task:i/device:GPU:0` (or CPU:0), i < count.

  Call after `connect_cluster`; a worker with a GPU gets its first GPU.
  """
  devices = []
  remote = [d.name for d in tf.config.list_logical_devices()]
  for task in range(count):
    prefix = f"/job:worker/replica:0/task:{task}/device:"
    kind = "GPU" if f"{prefix}GPU:0" in remote else "CPU"
    devices.append(f"{prefix}{kind}:0")
  return devices


def short_device(name):
  """`/job:localhost/replica:0/task:0/device:CPU:1` -> `/CPU:1` ('' if unset).

  Devices of other jobs keep their task: `/job:worker/task:1/CPU:0`.
  """
  if not name:
    return ""
  spec = tf.DeviceSpec.from_string(name)
  if spec.device_type is None:
    return name
  device = f"/{spec.device_type.upper()}:{spec.device_index or 0}"
  if spec.job and spec.job != "localhost":
    device = f"/job:{spec.job}/task:{spec.task or 0}{device}"
  return device


def variable_device(variable):
  """The short device of a Keras or TensorFlow variable."""
  if isinstance(variable, keras.Variable):
    variable = variable.value  # the tf.Variable behind a Keras one
  return short_device(variable.device)
