"""Which devices model-parallel pieces go on, and short names for them.

Stage or shard `i` goes on `/GPU:i` when there are enough GPUs, else on the
logical CPU device `/CPU:i` (split the host with
`framework.configure_cpu_devices(n)`).
"""

import keras
import tensorflow as tf

from framework.errors import ConfigError, check_positive


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


def short_device(name):
  """`/job:localhost/replica:0/task:0/device:CPU:1` -> `/CPU:1` ('' if unset)."""
  if not name:
    return ""
  spec = tf.DeviceSpec.from_string(name)
  if spec.device_type is None:
    return name
  return f"/{spec.device_type.upper()}:{spec.device_index or 0}"


def variable_device(variable):
  """The short device of a Keras or TensorFlow variable."""
  if isinstance(variable, keras.Variable):
    variable = variable.value  # the tf.Variable behind a Keras one
  return short_device(variable.device)
