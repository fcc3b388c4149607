"""Tensor parallelism's trainer, and which trainer a run's split gets.

`TensorParallelTrainer` splits one of two things across D devices:

A Dense pair (any Sequential model): one hidden layer's units. For the
pair `h = act(x W1 + b1)`, `y = act2(h W2 + b2)` with W1 [n, H] and
W2 [H, k], cut the H hidden units into D shards of H/D:

    column-parallel (device d):  h_d = act(x W1[:, d] + b1[d])      [B, H/D]
    row-parallel    (device d):  p_d = h_d W2[d, :]                 [B, k]
    output device:               y   = act2(sum_d p_d + b2)

`h` is never gathered: shard d's units only feed shard d's rows of W2, and
the partial products are summed. This equals the unsplit pair exactly (up to
the order of a float sum), e.g. a hidden layer of 10 units as 5 + 5.

A whole transformer (a model with a registered split,
`config.register_split`, e.g. models/gpt_parallel.py): the split
model trains as one device-pinned `Stage` (the split places its own ops and
gradients, `parallel_layers.on_device`), with the vocab-parallel
cross-entropy as its loss. With `replica_devices` (data x tensor) there is
one copy of the split per group of devices; each variable's gradient is
all-reduced across the copies' devices that hold it (the data axis only:
copy r's shard d meets the other copies' shard d), and every copy applies
the same update. With `tensor_stages` (tensor x pipeline) a group is the
copy's stages' shard devices one after another, and the split cuts its
blocks into stages.

Which trainer (`trainer_factory`, what `ModelParallelConfig.trainer_factory`
returns): `--model_parallel=tensor` is this trainer. `--model_parallel=
pipeline --num_stages=S` (the mesh `pipeline:S`, with `data:R` too) cuts a
model's layers into S stages (`PipelineTrainer`), except for a model with
a registered whole-model split (e.g. `gpt`, whose token table is read
twice: the lookup and the tied head, which a layer cut cannot place): it is
cut by its own split, one shard per stage, `TensorParallelTrainer(
num_shards=1, tensor_stages=S)`, the same S-stage pipeline of its blocks
(`pipeline_trainer`).
"""

import functools

from absl import logging
import keras
import tensorflow as tf

from framework import _tf_internal
from framework.core.trainer import Trainer
from framework.errors import ConfigError, check_positive
from framework.model_parallel.config import SplitConfig, split_for
from framework.model_parallel.copies import all_reduce_copies
from framework.model_parallel.devices import (cluster_devices,
                                              model_parallel_devices,
                                              short_device, variable_device)
from framework.model_parallel.parallel_layers import (
    CheckpointNode, ColumnParallelLinear, checkpoint_mirror, RowParallelLinear,
    sharded_sparse_categorical_loss, unsplit_view,
    vocab_parallel_statistics)
from framework.model_parallel.pipeline import PipelineTrainer, model_layers
from framework.model_parallel.staged_trainer import (ParallelStage, Stage,
                                                     StagedTrainer)
from framework.settings import default


# What a tensor split of a model without a whole-model split is, in errors.
_DENSE_PAIR = ("tensor parallelism of a model other than gpt (one Dense "
               "pair split)")


class ColumnParallelDense(ColumnParallelLinear):
  """A Dense whose output units are split across `devices`: the
  `ColumnParallelLinear` of a Dense pair split.

  `call(x)` returns the list of D shards `[B, units / D]`, shard d computed
  on devices[d] with the variables that live there. Its weights are made
  and checkpointed as one Dense layer per shard (`shards/<d>/kernel`,
  `shards/<d>/bias`).
  """

  by_shard = True

  def _trackable_children(self, save_type="checkpoint", **kwargs):
    # As the Dense pair always checkpointed it: its variables only through
    # the optimizer (`optimizer/_trainable_variables/<i>`).
    return {}


class RowParallelDense(RowParallelLinear):
  """A Dense whose input units arrive as shards, one per device: the
  `RowParallelLinear` of a Dense pair split.

  Shard d's partial product `h_d W[d]` runs on devices[d]; the sum, bias and
  activation run on `output_device`. Checkpointed as one Dense layer per
  shard without a bias (`shards/<d>/kernel`) and the bias
  (`output_layer/bias`).
  """

  by_shard = True

  def _trackable_children(self, save_type="checkpoint", **kwargs):
    # As the Dense pair always checkpointed it (the shards' kernels only
    # through the optimizer).
    return {"output_layer": self.output_layer}


class CheckpointLayout:
  """Which keys a split model's checkpoint has (plain, untracked state).

  Attributes:
    children: the unsplit model's checkpoint tree over the split's weights
      (`parallel_layers.checkpoint_mirror`), or None: the split's own keys.
    weights: id(unsplit variable) -> the split's weight in its place.
    own_keys: read (restore) the split's own keys, as a Dense pair split
      saved them before it saved the unsplit model's (`read_own_keys`).
  """

  def __init__(self):
    self.children = None
    self.weights = {}
    self.own_keys = False


class TensorParallelModel(keras.Model):
  """`before` layers, a column/row-parallel pair, `after` layers.

  Checkpointed under the keys of the model it was split from
  (`split_dense_pair` sets `layout`), else under its own.
  """

  def __init__(self, before, column, row, after, device, **kwargs):
    super().__init__(**kwargs)
    self.before = list(before)
    self.column = column
    self.row = row
    self.after = list(after)
    self.host_device = device
    self.layout = CheckpointLayout()

  def _trackable_children(self, save_type="checkpoint", **kwargs):
    layout = self.layout
    if layout.children is None or layout.own_keys:
      return super()._trackable_children(save_type, **kwargs)
    return dict(layout.children)

  def checkpoint_weights(self, model):
    """For each trainable variable of the unsplit `model`, in its order,
    this split's weight in its place (a variable or `ShardedWeight`)."""
    return [self.layout.weights[id(v)] for v in model.trainable_variables]

  def call(self, x, training=False):
    with tf.device(self.host_device):
      for layer in self.before:
        x = layer(x, training=training)
    x = self.row(self.column(x))
    with tf.device(self.host_device):
      for layer in self.after:
        x = layer(x, training=training)
    return x


def _is_dense(layer):
  return type(layer) is keras.layers.Dense  # pylint: disable=unidiomatic-typecheck


def default_split_layer(layers):
  """The last Dense layer directly followed by a Dense layer (or None)."""
  candidates = [i for i in range(len(layers) - 1)
                if _is_dense(layers[i]) and _is_dense(layers[i + 1])]
  return candidates[-1] if candidates else None


def check_split_layer(layers, index, num_shards):
  """Raises ConfigError unless layers[index] can be split num_shards ways."""
  names = ", ".join(f"{i}:{type(l).__name__}" for i, l in enumerate(layers))
  if index is None:
    raise ConfigError(
        "tensor parallelism needs a Dense layer followed directly by a Dense "
        f"layer (a Dropout in between cannot be split; disable it, e.g. "
        "--nodropout); the "
        f"model's layers are {names}")
  if not 0 <= index < len(layers) - 1:
    raise ConfigError(f"split_layer={index} must be a layer index in "
                      f"0..{len(layers) - 2} (layers: {names})")
  layer, consumer = layers[index], layers[index + 1]
  if not (_is_dense(layer) and _is_dense(consumer)):
    raise ConfigError(
        f"split_layer={index} ({type(layer).__name__} followed by "
        f"{type(consumer).__name__}) cannot be split: it must be a Dense "
        f"layer followed directly by a Dense layer (layers: {names})")
  if layer.units % num_shards:
    raise ConfigError(
        f"split_layer={index} has {layer.units} units, which cannot be split "
        f"evenly across num_shards={num_shards}")
  for i, dense in ((index, layer), (index + 1, consumer)):
    # The split layers carry kernel, bias and activation only: anything
    # else would be dropped silently (other numbers than the unsplit model).
    unsupported = [f"{name}={type(getattr(dense, name)).__name__}"
                   for name in _UNSUPPORTED if getattr(dense, name, None)]
    if not dense.use_bias:
      unsupported.append("use_bias=False")
    if unsupported:
      raise ConfigError(
          f"layer {i} ({dense.name}) of the Dense pair at split_layer={index} "
          f"has {', '.join(unsupported)}, which a tensor split does not "
          "support yet; build the pair with use_bias=True and no "
          "regularisers or constraints (use optimizer=adamw for weight "
          "decay), or use another split_layer")
  return index


_UNSUPPORTED = ("kernel_regularizer", "bias_regularizer",
                "activity_regularizer", "kernel_constraint", "bias_constraint")


def split_dense_pair(model, index, devices):
  """A `TensorParallelModel` equal to `model` with layers[index] split.

  layers[index] becomes column-parallel and layers[index + 1] row-parallel
  over `devices`; the other layers stay on devices[0]. The weights are the
  model's, sliced.
  """
  layers = model_layers(model, _DENSE_PAIR)
  check_split_layer(layers, index, len(devices))
  dense, consumer = layers[index], layers[index + 1]
  host = devices[0]
  kernel, bias = dense.get_weights()
  consumer_kernel, consumer_bias = consumer.get_weights()

  def copy(layer):
    return type(layer).from_config(layer.get_config())

  with keras.name_scope(model.name):
    with tf.device(host):
      before = [copy(layer) for layer in layers[:index]]
      after = [copy(layer) for layer in layers[index + 2:]]
    column = ColumnParallelDense(dense.units, devices,
                                 activation=dense.activation, name=dense.name)
    row = RowParallelDense(consumer.units, devices,
                           activation=consumer.activation,
                           output_device=host, name=consumer.name)
    placed = TensorParallelModel(before, column, row, after, host,
                                 name=model.name)
    # Build eagerly, piece by piece: a device scope inside a symbolic call
    # does not reach the variables Keras creates there.
    x = keras.Input(shape=model.input_shape[1:])
    with tf.device(host):
      for layer in before:
        x = layer(x)
    column.build(x.shape)
    row.build((None, dense.units))
    y = keras.Input(shape=(consumer.units,))
    with tf.device(host):
      for layer in after:
        y = layer(y)
    placed(keras.Input(shape=model.input_shape[1:]))  # all built: no new vars
  weights = {}
  for old, new in zip(layers[:index] + layers[index + 2:], before + after):
    new.set_weights(old.get_weights())
    weights.update((id(a), b) for a, b in zip(old.weights, new.weights))
  column.kernel.assign(kernel)
  column.bias.assign(bias)
  row.kernel.assign(consumer_kernel)
  row.bias.assign(consumer_bias)
  weights.update({id(dense.kernel): column.kernel, id(dense.bias): column.bias,
                  id(consumer.kernel): row.kernel,
                  id(consumer.bias): row.bias})
  # Checkpointed as the unsplit model: the cut weights whole, at its paths.
  placed.layout.weights = weights
  placed.layout.children = _tf_internal.trackable_children(
      checkpoint_mirror(model, weights))
  return placed


def merge_dense_pair(placed, model, index):
  """Writes the weights of `placed` (see `split_dense_pair`) into `model`."""
  layers = model_layers(model, _DENSE_PAIR)
  column, row = placed.column, placed.row
  for old, new in zip(layers[:index] + layers[index + 2:],
                      placed.before + placed.after):
    old.set_weights(new.get_weights())
  layers[index].set_weights([column.kernel.numpy(), column.bias.numpy()])
  layers[index + 1].set_weights([row.kernel.numpy(), row.bias.numpy()])
  return model


class _LayoutSwitch(CheckpointNode):
  """A Dense pair split's optimizer in checkpoints: as an unsplit run's
  (`view`), or the `optimizer` itself while `layout.own_keys` (a restore
  of the split's own keys)."""

  def __init__(self, layout, optimizer, view):
    self.layout, self.optimizer, self.view = layout, optimizer, view

  def _trackable_children(self, save_type="checkpoint", **kwargs):
    source = self.optimizer if self.layout.own_keys else self.view
    return _tf_internal.trackable_children(source)


def own_keys_checkpoint(path):
  """Whether checkpoint `path` holds a Dense pair split under its own keys
  (the model's `column` and `row`, not the unsplit model's layers). Read
  from the checkpoint's object graph; nothing in it runs."""
  try:
    reader = tf.train.load_checkpoint(path)
    graph = _tf_internal.checkpoint_object_graph(reader)
  except (tf.errors.OpError, ValueError, IndexError):
    # IndexError: a data file shorter than its index says.
    return False  # damaged or foreign: the restore says so in one line
  model = [c.node_id for c in graph.nodes[0].children
           if c.local_name == "model"]
  names = {c.local_name for node in model
           for c in graph.nodes[node].children}
  return {"column", "row"} <= names


def check_groups(groups, num_shards):
  """Raises ConfigError unless `groups` are lists of num_shards devices."""
  if any(len(g) != num_shards for g in groups):
    raise ConfigError(f"replica_devices={[list(g) for g in groups]} must be "
                      f"lists of num_shards={num_shards} devices")


def split_setup(split, model, optimizer, strategy, *, devices,
                replica_devices, kwargs,
                tensor_stages=default(SplitConfig, "tensor_stages")):
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
    placed = (split(model, groups[0], tensor_stages=tensor_stages)
              if tensor_stages > 1 else split(model, groups[0]))
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
  for indices, devices in position_groups(variables[0], groups):
    reduced = all_reduce_copies(
        [[grads[i] for i in indices] for grads in per_copy], devices)
    for r, grads in enumerate(reduced):
      for i, grad in zip(indices, grads):
        summed[r][i] = grad
  return summed


def position_groups(variables, groups):
  """[(indices of `variables` on device position d, the R copies' device
  d)], by position: what the copies reduce together.

  Args:
    variables: one copy's variables (copy 0's, on groups[0]).
    groups: R lists of the copies' D devices.
  """
  # Short names on both sides: a variable reports `/job:worker/task:0/CPU:0`
  # for a group's `/job:worker/replica:0/task:0/device:CPU:0`.
  position = {short_device(device): d for d, device in enumerate(groups[0])}
  by_shard = {}
  for i, variable in enumerate(variables):
    by_shard.setdefault(position[variable_device(variable)], []).append(i)
  return [(indices, [group[d] for group in groups])
          for d, indices in sorted(by_shard.items())]


class TensorParallelTrainer(StagedTrainer):
  """Trains a Sequential model with one hidden Dense split across devices,
  or a whole transformer (a model with a registered split, e.g. `gpt`:
  every block, the embedding and the head; see the module).

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
    split = split_for(model)
    if split is not None:  # a whole transformer (see the module)
      count = num_shards * tensor_stages
      if replica_devices and not devices:
        devices = replica_devices[0]  # copy 0's, local or on a cluster task
      devices = list(devices or model_parallel_devices(
          count * len(replica_devices or [()]), name="num_shards"))
      devices = devices[:count]
      placed, stages, copies, kwargs = split_setup(
          split, model, optimizer, strategy, devices=devices,
          replica_devices=replica_devices, kwargs=kwargs,
          tensor_stages=tensor_stages)
      self.split_layer = None
      self._unsplit = model
      self.layers_place_blocks = True  # `on_device` blocks
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
    if tensor_stages > 1:
      raise ConfigError(
          f"tensor x pipeline (tensor_stages={tensor_stages}) needs a model "
          f"with a whole-model split (model=gpt); {model.name} splits one "
          "Dense pair only")
    if replica_devices:
      raise ConfigError(
          "data x tensor parallelism needs a model with a whole-model "
          f"split (model=gpt); {model.name} splits one Dense pair on one "
          "group of devices only")
    layers = model_layers(model, _DENSE_PAIR)
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
    # Checkpoints hold the model and optimizer as an unsplit run's: any
    # split (or none) resumes from them.
    try:
      view = unsplit_view(self.optimizer, model.trainable_variables,
                          placed.checkpoint_weights(model))
      self._unsplit_optimizer = _LayoutSwitch(placed.layout, self.optimizer,
                                              view)
    except (TypeError, ValueError, NotImplementedError) as e:
      placed.layout.children = None  # its own keys, as the optimizer's
      logging.warning(
          "optimizer %s: the split's checkpoints hold its shards under their "
          "own keys (%s); they resume on this split only",
          type(self.optimizer).__name__, str(e).splitlines()[0][:200])

  def read_own_keys(self, own_keys=True):
    """Restores read a Dense pair split's own keys (its shards, the split
    optimizer's lists: what distloop saved before it saved the unsplit
    model's keys), until called with False."""
    if self.split_layer is not None:
      self.model.layout.own_keys = own_keys

  def _copy_groups(self):
    """Data x tensor: the gradients of the variables on each device
    position, reduced over the copies' devices of that position."""
    if self.split_layer is not None:
      return super()._copy_groups()
    all_stages = [self.stages] + [stages for stages, _, _ in self.copies]
    return position_groups(self.variables,
                           [stages[0].layers[0].devices
                            for stages in all_stages])

  @property
  def unsplit_model(self):
    """The model whose architecture a resume checks: the model it was cut
    from (the same on every mesh; its weights are the initial ones until
    `export_model`); the split model where its checkpoint keys are its own
    (a Dense pair whose optimizer has no unsplit view)."""
    if self.split_layer is not None and self.model.layout.children is None:
      return self.model
    return self._unsplit

  @property
  def checkpointed_optimizer(self):
    """What checkpoints hold as `optimizer`: for a transformer split, the
    optimizer as an unsplit run's (`parallel_layers.unsplit_view`)."""
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


def pipeline_trainer(model, optimizer, strategy, *, pipeline_cls, split_cls,
                     num_stages, stage_boundaries=None, stage_balance=None,
                     **kwargs):
  """The trainer of an S-stage pipeline of `model`.

  Args:
    model, optimizer, strategy: as for `Trainer`.
    pipeline_cls: the layer-cutting trainer (a `PipelineTrainer`).
    split_cls: the whole-model split's trainer (a `TensorParallelTrainer`),
      for a model `split_for` knows (None: the layer cut for every model).
    num_stages: S.
    stage_boundaries, stage_balance: the layer cut's (a whole-model split
      cuts its blocks evenly itself).
    **kwargs: both trainers' (micro-batches, devices, replica_devices,
      recompute, ..., the `Trainer` arguments).

  Raises:
    ConfigError: stage boundaries given for a model cut by its own split.
  """
  if split_cls is None or split_for(model) is None:
    return pipeline_cls(model, optimizer, strategy, num_stages=num_stages,
                        stage_boundaries=stage_boundaries,
                        stage_balance=stage_balance, **kwargs)
  if stage_boundaries:
    raise ConfigError(
        f"stage_boundaries={list(stage_boundaries)} cut a list of layers; "
        f"model={model.name} is cut into its num_stages={num_stages} stages "
        "by its own split (its blocks, evenly); drop --stage_boundaries")
  logging.info(
      "model=%s has a whole-model split: its %d-stage pipeline runs as "
      "%s(num_shards=1, tensor_stages=%d), its blocks cut into stages (not "
      "%s's layer cut)", model.name, num_stages, split_cls.__name__,
      num_stages, pipeline_cls.__name__)
  return split_cls(model, optimizer, strategy, num_shards=1,
                   tensor_stages=num_stages, **kwargs)


def trainer_factory(config, trainer_cls=None):
  """`trainer_cls`, or the model-parallel trainer bound to `config` (a
  `ModelParallelConfig`).

  A plain `Trainer` subclass (e.g. the segmentation trainer, for its
  evaluation metrics) is combined with the model-parallel trainer: the
  split trains, the subclass evaluates the (whole) model.
  """
  trainer_cls = trainer_cls or Trainer
  if config.mode == "none":
    return trainer_cls

  def combined(parallel_cls):
    if trainer_cls is Trainer or issubclass(trainer_cls, parallel_cls):
      return parallel_cls if trainer_cls is Trainer else trainer_cls
    if not issubclass(trainer_cls, Trainer) or issubclass(
        trainer_cls, StagedTrainer):
      raise ConfigError(
          f"model_parallel={config.mode} needs a trainer derived from "
          f"{parallel_cls.__name__}; got {trainer_cls.__name__}")
    # The split's eval_logits, the subclass's eval_sums and eval_results.
    # TensorParallel + LanguageModelTrainer -> TensorParallelLanguageModel
    # Trainer (the name logs and model_info.json show).
    name = (parallel_cls.__name__.removesuffix("Trainer") +
            trainer_cls.__name__)
    return type(name, (parallel_cls, trainer_cls), {})

  devices = None
  if config.devices == "cluster" and not config.replica_devices:
    devices = cluster_devices(config.device_count[0])
  if config.mode == "pipeline":
    # A model with its own whole-model split (gpt) runs it as the
    # pipeline; any other has its layers cut (`pipeline_trainer`).
    pipeline_cls = combined(PipelineTrainer)
    split_cls = (combined(TensorParallelTrainer)
                 if not issubclass(trainer_cls, PipelineTrainer)
                 else None)
    return functools.partial(
        pipeline_trainer, pipeline_cls=pipeline_cls, split_cls=split_cls,
        num_stages=config.num_stages,
        num_microbatches=config.num_microbatches,
        stage_boundaries=tuple(config.stage_boundaries) or None,
        stage_balance=config.stage_balance, recompute=config.recompute,
        serial_stages=config.serial_stages,
        input_grads_first=config.input_grads_first, devices=devices,
        **({"replica_devices": [list(g) for g in config.replica_devices]}
           if config.replica_devices else {}))
  return functools.partial(
      combined(TensorParallelTrainer), num_shards=config.num_shards,
      split_layer=config.split_layer,
      num_microbatches=config.num_microbatches, recompute=config.recompute,
      serial_stages=config.serial_stages,
      input_grads_first=config.input_grads_first, devices=devices,
      **({"tensor_stages": config.tensor_stages} if config.tensor_stages > 1
         else {}),
      **({"replica_devices": [list(g) for g in config.replica_devices]}
         if config.replica_devices else {}))
