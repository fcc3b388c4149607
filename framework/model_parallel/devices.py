"""Which devices model-parallel pieces go on, and short names for them.

Stage or shard `i` goes on `/GPU:i` when GPUs exist, else on the logical CPU
device `/CPU:i` (split the host with `framework.configure_cpu_devices(n)`).
"""

import keras
import tensorflow as tf

from framework.errors import ConfigError, check_positive


def model_parallel_devices(count, *, name="num_stages"):
  """The first `count` accelerator (or logical CPU) devices, e.g. `/CPU:0`.

  Args:
    count: how many devices the split needs.
    name: the argument that asked for them (named in the error).
  Raises:
    ConfigError: fewer than `count` devices exist.
  """
  check_positive(name, count)
  device_type = "GPU" if tf.config.list_logical_devices("GPU") else "CPU"
  available = len(tf.config.list_logical_devices(device_type))
  if count > available:
    hint = ("" if device_type == "GPU" else
            f"; split the CPU with --cpu_devices={count}")
    raise ConfigError(f"{name}={count} needs {count} devices but only "
                      f"{available} {device_type} device(s) exist{hint}")
  return [f"/{device_type}:{i}" for i in range(count)]


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
