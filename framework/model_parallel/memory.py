"""Bytes of parameters, optimizer slots and activations on each device.

The point of model parallelism is that no device has to hold the whole model:
these figures (logged at start-up and written to TensorBoard as
`memory/<device>/param_bytes`, `.../optimizer_slot_bytes` and
`.../activation_bytes`) show how much each device holds.

Activations are computed, not measured (`get_memory_info` does not work on
CPU devices): the bytes each stage keeps between its forward and backward
pass, from the static shapes of its input and its layers' outputs, for all
M micro-batches (GPipe runs every forward before any backward, so the whole
global batch is in flight). With recomputation a stage keeps only its
inputs; its backward pass then holds one micro-batch's outputs for a moment
on top (not counted). It is an estimate of what TensorFlow keeps: some ops
keep less (a Flatten's output is a view), some keep their own temporaries.
"""

import numpy as np
import tensorflow as tf

from framework import _tf_internal
from framework.model_parallel.devices import short_device, variable_device


def _nbytes(variable):
  return int(np.prod(variable.shape)) * tf.as_dtype(variable.dtype).size


def _optimizer_bookkeeping(optimizer):
  """The step counter and learning-rate variable: not per-parameter slots."""
  ids = {id(optimizer.iterations)}
  learning_rate = _tf_internal.learning_rate_variable(optimizer)
  if learning_rate is not None:
    ids.add(id(learning_rate))
  return ids


def memory_by_device(model, optimizer):
  """`{device: {"param_bytes": n, "optimizer_slot_bytes": n}}`.

  Parameters are all model weights (trainable or not, e.g. BatchNorm
  statistics); slots are the optimizer's per-parameter variables (Adam's
  moments), found on whatever device they were created on (with the state
  sharded over a mesh's data axis, `copy_sharding`: this copy's 1/R).
  """
  report = {}

  def add(variable, key):
    entry = report.setdefault(variable_device(variable) or "unplaced",
                              {"param_bytes": 0, "optimizer_slot_bytes": 0})
    entry[key] += _nbytes(variable)

  for weight in model.weights:
    add(weight, "param_bytes")
  bookkeeping = _optimizer_bookkeeping(optimizer)
  # By name too: a mesh copy's optimizer keeps an unused step counter of
  # its own (it counts in copy 0's).
  for variable in _tf_internal.optimizer_slot_variables(optimizer):
    if id(variable) not in bookkeeping:
      add(variable, "optimizer_slot_bytes")
  return dict(sorted(report.items()))


def add_activations(report, stages, global_batch_size, recompute=False):
  """Adds `activation_bytes` (peak, all micro-batches) per device to `report`.

  Args:
    report: from `memory_by_device`; changed in place.
    stages: the trainer's stages (`activation_bytes(recompute)` per example).
    global_batch_size: B; M micro-batches of B/M are all kept at once.
  """
  for stage in stages:
    for leaf in stage.leaves:
      per_example = getattr(leaf, "activation_bytes", lambda _: None)(
          recompute)
      if per_example is None:
        continue
      entry = report.setdefault(short_device(leaf.device),
                                {"param_bytes": 0, "optimizer_slot_bytes": 0})
      entry["activation_bytes"] = (entry.get("activation_bytes", 0) +
                                   per_example * global_batch_size)
  return report


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
      f"{entry['optimizer_slot_bytes']} B" + (
          f", activations {entry['activation_bytes']} B"
          if "activation_bytes" in entry else "")
      for device, entry in report.items())
