"""Tensor parallelism for a whole transformer: the setup of its trainer.

`TensorParallelTrainer` given a model with a registered split
(`parallel_layers.register_split`, e.g. models/gpt_parallel.py) trains the
split model as one device-pinned `Stage` (the split places its own ops and
gradients, `parallel_ops`), with the vocab-parallel cross-entropy as its
loss. With `replica_devices` (data x tensor) there is one copy of the split
per group of devices; each variable's gradient is all-reduced across the
copies' devices that hold it (the data axis only: copy r's shard d meets
the other copies' shard d), and every copy applies the same update.
"""

from framework.errors import ConfigError
from framework.model_parallel.parallel_layers import (
    sharded_sparse_categorical_loss, vocab_parallel_statistics)
from framework.model_parallel.stages import Stage


def check_groups(groups, num_shards):
  """Raises ConfigError unless `groups` are lists of num_shards devices."""
  if any(len(g) != num_shards for g in groups):
    raise ConfigError(f"replica_devices={[list(g) for g in groups]} must be "
                      f"lists of num_shards={num_shards} devices")


def split_setup(split, model, optimizer, strategy, *, devices,
                replica_devices, kwargs):
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
    placed = split(model, groups[0])
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
