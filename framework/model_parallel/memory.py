"""Bytes of parameters and optimizer slots on each device.

The point of model parallelism is that no device has to hold the whole model:
these figures (logged at start-up and written to TensorBoard as
`memory/<device>/param_bytes` and `memory/<device>/optimizer_slot_bytes`)
show how much each device holds. Activations are not counted.
"""

import numpy as np
import tensorflow as tf

from framework.model_parallel.devices import variable_device


def _nbytes(variable):
  return int(np.prod(variable.shape)) * tf.as_dtype(variable.dtype).size


def _optimizer_bookkeeping(optimizer):
  """The step counter and learning-rate variable: not per-parameter slots."""
  ids = {id(optimizer.iterations)}
  learning_rate = getattr(optimizer, "_learning_rate", None)
  if hasattr(learning_rate, "assign"):
    ids.add(id(learning_rate))
  return ids


def memory_by_device(model, optimizer):
  """`{device: {"param_bytes": n, "optimizer_slot_bytes": n}}`.

  Parameters are all model weights (trainable or not, e.g. BatchNorm
  statistics); slots are the optimizer's per-parameter variables (Adam's
  moments), found on whatever device they were created on.
  """
  report = {}

  def add(variable, key):
    entry = report.setdefault(variable_device(variable) or "unplaced",
                              {"param_bytes": 0, "optimizer_slot_bytes": 0})
    entry[key] += _nbytes(variable)

  for weight in model.weights:
    add(weight, "param_bytes")
  bookkeeping = _optimizer_bookkeeping(optimizer)
  for variable in optimizer.variables:
    if id(variable) not in bookkeeping:
      add(variable, "optimizer_slot_bytes")
  return dict(sorted(report.items()))


def memory_metrics(report):
  """The report as flat scalars for TensorBoard (`memory/CPU_1/param_bytes`)."""
  metrics = {}
  for device, entry in report.items():
    tag = device.strip("/").replace(":", "_").replace("/", "_")
    for key, value in entry.items():
      metrics[f"memory/{tag}/{key}"] = float(value)
  return metrics


def format_memory(report):
  """One line per device, e.g. `/CPU:0 params 1.2 MiB, optimizer slots ...`."""
  return "; ".join(
      f"{device}: params {entry['param_bytes']} B, optimizer slots "
      f"{entry['optimizer_slot_bytes']} B" for device, entry in report.items())
