"""Tensor parallelism's trainer: a Dense pair (`dense_pair`) or a whole
transformer (`transformer_split`) split across D devices, with data and
pipeline axes (a mesh) on top.
"""

from absl import logging
import tensorflow as tf

from framework.errors import ConfigError, check_positive
from framework.model_parallel.dense_pair import (check_split_layer,
                                                 default_split_layer,
                                                 merge_dense_pair,
                                                 split_dense_pair)
from framework.model_parallel.devices import model_parallel_devices
from framework.model_parallel.parallel_layers import split_for
from framework.model_parallel.split_checkpoint import unsplit_view
from framework.model_parallel.split_config import SplitConfig
from framework.settings import default
from framework.model_parallel.pipeline import model_layers
from framework.model_parallel.staged_trainer import StagedTrainer
from framework.model_parallel.stages import ParallelStage, Stage
from framework.model_parallel.transformer_split import (all_reduce_by_shard,
                                                        sharded_correct,
                                                        split_setup)


class TensorParallelTrainer(StagedTrainer):
  """Trains a Sequential model with one hidden Dense split across devices,
  or a whole transformer (a model with a registered split, e.g. `gpt`:
  every block, the embedding and the head; see `transformer_split`).

  Args:
    model: a built `keras.Sequential`; copied into a `TensorParallelModel`
      (`self.model`).
    optimizer, strategy: as for `Trainer` (one replica).
    num_shards: D, the devices the hidden units are split across.
    split_layer: index (in `model.layers`) of the Dense to split; it must be
      followed directly by a Dense. Default: the last such layer.
    num_microbatches: optional micro-batching (as in the pipeline).
    devices: D device names; default `/GPU:0..` or `/CPU:0..`.
    replica_devices: data x tensor (transformer splits only): R lists of D
      (D * tensor_stages) devices, one copy of the split on each.
    tensor_stages: tensor x pipeline (transformer splits only): the blocks cut
      into this many stages, each split across its own D devices.
    **kwargs: `Trainer` arguments.
  """

  def __init__(self, model, optimizer, strategy, *,
               num_shards=default(SplitConfig, "num_shards"),
               split_layer=default(SplitConfig, "split_layer"),
               num_microbatches=default(SplitConfig, "num_microbatches"),
               devices=None, replica_devices=None,
               tensor_stages=default(SplitConfig, "tensor_stages"), **kwargs):
    check_positive("tensor_stages", tensor_stages)
    self._unsplit_optimizer = None  # a transformer split's checkpoint view
    num_stages = tensor_stages
    split = split_for(model)
    if split is not None:  # a whole transformer (see transformer_split)
      count = num_shards * num_stages
      if replica_devices and not devices:
        devices = replica_devices[0]  # copy 0's, local or on a cluster task
      devices = list(devices or model_parallel_devices(
          count * len(replica_devices or [()]), name="num_shards"))
      devices = devices[:count]
      placed, stages, copies, kwargs = split_setup(
          split, model, optimizer, strategy, devices=devices,
          replica_devices=replica_devices, kwargs=kwargs,
          num_stages=num_stages)
      self.split_layer = None
      self._unsplit = model
      super().__init__(placed, optimizer, strategy, stages=stages,
                       num_microbatches=num_microbatches, copies=copies,
                       **kwargs)
      # Checkpoints hold the optimizer as an unsplit run's: any mesh
      # (or none) resumes from them.
      try:
        sharding = self.copy_sharding  # ZeRO-1 on the data axis, or None
        view = unsplit_view(
            self.optimizer, model.trainable_variables,
            placed.checkpoint_weights(model),
            state=sharding and sharding.checkpointed_optimizer,
            index=sharding and sharding.checkpoint_index)
        self._unsplit_optimizer = view
      except (TypeError, ValueError, NotImplementedError) as e:
        # An optimizer Keras cannot rebuild from its config: the split
        # trains, its checkpoints resume on this split only.
        logging.warning(
            "optimizer %s: its state is checkpointed as this split's (%s); "
            "the checkpoints resume on this split only",
            type(self.optimizer).__name__, str(e).splitlines()[0][:200])
      return
    if num_stages > 1:
      raise ConfigError(
          f"tensor x pipeline (tensor_stages={num_stages}) needs a model with a "
          f"whole-model split (model=gpt); {model.name} splits one Dense "
          "pair only")
    if replica_devices:
      raise ConfigError(
          "data x tensor parallelism needs a model with a whole-model "
          f"split (model=gpt); {model.name} splits one Dense pair on one "
          "group of devices only")
    layers = model_layers(model)
    if split_layer is None:
      split_layer = default_split_layer(layers)
    check_split_layer(layers, split_layer, num_shards)
    devices = list(devices or model_parallel_devices(num_shards,
                                                     name="num_shards"))
    with strategy.scope():
      placed = split_dense_pair(model, split_layer, devices)
    self.split_layer = split_layer
    self._unsplit = model
    host = devices[0]
    # before (host) -> D branches (column shard + row shard) -> sum,
    # bias and after (host).
    branches = [Stage(f"shard_{d}", device,
                      [placed.column.shards[d], placed.row.shards[d]])
                for d, device in enumerate(devices)]
    stages = [Stage("stage_0", host, placed.before),
              ParallelStage("stage_1", host, branches),
              Stage("stage_2", host, [placed.row.output_layer,
                                      *placed.after])]
    super().__init__(placed, optimizer, strategy, stages=stages,
                     num_microbatches=num_microbatches, **kwargs)

  def _copies_gradients(self, features, labels):
    """Data x tensor: as for a pipeline, but each shard's gradients are
    all-reduced across the copies' devices of that shard."""
    if self.split_layer is not None:
      return super()._copies_gradients(features, labels)
    all_stages = [self.stages] + [stages for stages, _, _ in self.copies]
    per_copy, losses, accuracies = [], [], []
    for stages, x, y in zip(all_stages, tf.split(features, len(all_stages)),
                            tf.split(labels, len(all_stages))):
      grads, loss, accuracy = self._pipeline_gradients(stages, x, y)
      per_copy.append(grads[0])  # one stage: the whole split model
      losses.append(loss)
      accuracies.append(accuracy)
    summed = all_reduce_by_shard(
        per_copy, [stages[0].trainable_variables for stages in all_stages],
        [stages[0].layers[0].devices for stages in all_stages])
    with tf.device(self.stages[-1].device):
      return summed, tf.add_n(losses), tf.add_n(accuracies)

  @property
  def unsplit_model(self):
    """The model whose architecture a resume checks: for a transformer
    split the model it was cut from (the same on every mesh; its weights
    are the initial ones until `export_model`), for a Dense pair the split
    model (whose checkpoint is its own)."""
    return self._unsplit if self.split_layer is None else self.model

  @property
  def checkpointed_optimizer(self):
    """What checkpoints hold as `optimizer`: for a transformer split, the
    optimizer as an unsplit run's (`split_checkpoint.unsplit_view`)."""
    if self._unsplit_optimizer is not None:
      return self._unsplit_optimizer
    return super().checkpointed_optimizer

  def correct(self, labels, logits):
    """As `Trainer.correct`; over logit shards for a transformer split."""
    if isinstance(logits, (list, tuple)):
      return sharded_correct(labels, logits)
    return super().correct(labels, logits)

  def export_model(self):
    """The unsplit model with the trained weights (shards concatenated)."""
    if self.split_layer is None:
      return self.model.save_weights_to(self._unsplit)
    return merge_dense_pair(self.model, self._unsplit, self.split_layer)
