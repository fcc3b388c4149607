"""Tensor parallelism for a whole transformer: the setup of its trainer.

`TensorParallelTrainer` given a model with a registered split
(`parallel_layers.register_split`, e.g. models/gpt_parallel.py) trains the
split model as one device-pinned `Stage` (the split places its own ops and
gradients, `parallel_ops`), with the vocab-parallel cross-entropy as its
loss. With `replica_devices` (data x tensor) there is one copy of the split
per group of devices; each variable's gradient is all-reduced across the
copies' devices that hold it (the data axis only: copy r's shard d meets
the other copies' shard d), and every copy applies the same update.
With `num_stages` (tensor x pipeline) a group is the copy's stages' shard
devices one after another, and the split cuts its blocks into stages.
"""

import tensorflow as tf

from framework.errors import ConfigError
from framework.model_parallel.devices import variable_device
from framework.model_parallel.replicas import all_reduce_copies
from framework.model_parallel.parallel_layers import (
    sharded_sparse_categorical_loss, vocab_parallel_statistics)
from framework.model_parallel.stages import Stage


def check_groups(groups, num_shards):
  """Raises ConfigError unless `groups` are lists of num_shards devices."""
  if any(len(g) != num_shards for g in groups):
    raise ConfigError(f"replica_devices={[list(g) for g in groups]} must be "
                      f"lists of num_shards={num_shards} devices")


def split_setup(split, model, optimizer, strategy, *, devices,
                replica_devices, kwargs, num_stages=1):
  """(placed model, stages, copies, trainer kwargs) of a transformer split.

  Raises:
    ConfigError: a loss other than the default (the split computes its own
      vocab-parallel cross-entropy), or bad device groups.
  """
  loss_fn = kwargs.get("loss_fn")
  if loss_fn is not None and getattr(loss_fn, "__name__", "") != (
      "sparse_categorical_loss"):
    raise ConfigError(
        f"model={model.name} split by tensor parallelism computes its own "
        "vocab-parallel cross-entropy; label_smoothing and other losses are "
        "not supported with it")
  groups = [list(g) for g in (replica_devices or [devices])]
  check_groups(groups, len(devices))
  with strategy.scope():
    placed = (split(model, groups[0], num_stages=num_stages)
              if num_stages > 1 else split(model, groups[0]))
  stages = [Stage("tensor_parallel", groups[0][0], [placed])]
  copies = []
  copy_config = dict(optimizer.get_config(), learning_rate=0.0)
  for r, group in enumerate(groups[1:], 1):
    with strategy.scope():
      clone = placed.replicate(group)
      copies.append(([Stage(f"copy_{r}_tensor_parallel", group[0], [clone])],
                     clone, type(optimizer).from_config(copy_config)))
  kwargs = dict(kwargs, loss_fn=sharded_sparse_categorical_loss)
  return placed, stages, copies, kwargs


def sharded_correct(labels, logits):
  """1.0 where the arg-max over all logit shards equals the label."""
  return vocab_parallel_statistics(logits, labels)[1]


def all_reduce_by_shard(per_copy, variables, groups):
  """Each copy's gradients summed over the copies, shard by shard.

  Args:
    per_copy: R lists of gradients, list r of copy r's `variables[r]`.
    variables: R lists of variables (same structure, copy r's on groups[r]).
    groups: R lists of the copies' D devices.
  Returns:
    R lists of summed gradients: the gradients of the variables on copy
    r's device d are all-reduced with the other copies' device d only (one
    collective group per model-axis position: the data axis).
  """
  summed = [list(grads) for grads in per_copy]
  position = {device: d for d, device in enumerate(groups[0])}
  by_shard = {}
  for i, variable in enumerate(variables[0]):
    by_shard.setdefault(position[variable_device(variable)], []).append(i)
  for d, indices in sorted(by_shard.items()):
    reduced = all_reduce_copies(
        [[grads[i] for i in indices] for grads in per_copy],
        [group[d] for group in groups])
    for r, grads in enumerate(reduced):
      for i, grad in zip(indices, grads):
        summed[r][i] = grad
  return summed
