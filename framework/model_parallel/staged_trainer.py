"""A Trainer whose step runs a model as device-pinned stages, GPipe-style.

One step on a global batch of B examples cut into M micro-batches of B/M:

    for m in 1..M:                      # forward: fill the pipeline
      x = micro_batch[m]
      for stage i in 1..S:  x = stage_i.forward(x)       # on device i
      loss_m = sum(per_example_loss(x)) / B              # full-batch scale
    for m in M..1:                      # backward: drain it
      dy = None
      for stage i in S..1:  dy, dW_i = stage_i.backward(m, dy)   # on device i
                            grad_i += dW_i                       # on device i
    apply(grad)                         # one optimizer update per step

Because each micro-batch loss is divided by the full batch size B, the
accumulated gradient is exactly the gradient of the full-batch mean loss, as
in the unsplit model. The ops of different stages have no data dependence
except the activations they pass on, so stage i works on micro-batch m+1
while stage i+1 works on micro-batch m (the GPipe schedule; see
docs/guide/model_parallel.md). R copies of the stages (data x pipeline) are
`pipeline_copies`.

Checkpoints, summaries and the Controller are unchanged: the model is still
one Keras model whose variables happen to live on several devices.
"""


from absl import logging
import tensorflow as tf

from framework.errors import ConfigError, check_positive
from framework.core.optimizer_sharding import CopyShardedState
from framework.model_parallel.devices import variable_device
from framework.model_parallel.memory import (add_activations, format_memory,
                                             memory_by_device, memory_metrics)
from framework.model_parallel.pipeline_copies import PipelineCopies, tf_variable
from framework.model_parallel.split_config import SplitConfig
from framework.settings import default
from framework.model_parallel.streams import DeviceStreams
from framework.core.trainer import Trainer


def _stream_key(stage):
  """A one-device stage's device; None for one spread over several."""
  leaves = stage.leaves
  return stage.device if len(leaves) == 1 and leaves[0] is stage else None


def update_scope(device):
  """The name scope of the optimizer updates on `device` (`update_CPU_1`)."""
  return "update_" + device.strip("/").replace(":", "_")


class StagedTrainer(PipelineCopies, Trainer):
  """Trains a model given as device-pinned stages (`stages.Stage`).

  Args:
    model: the Keras model whose variables the stages use (checkpointed).
    optimizer, strategy: as for `Trainer`; the strategy must have one replica
      (model parallelism splits the model, not the batch).
    stages: `Stage`/`ParallelStage` objects in order; the last one is a
      `Stage` (it computes the loss). Together they must use every
      trainable variable of `model` exactly once.
    num_microbatches: M; `global_batch_size` must be divisible by it.
    recompute: keep only each stage's inputs per micro-batch and run its
      forward pass again in the backward pass (GPipe's re-materialisation:
      less activation memory, one more forward pass per step).
    serial_stages: each stage device runs its ops one at a time, in program
      order, as a GPU stream would (`streams.DeviceStreams`); by default
      TensorFlow may run several ops of one logical CPU device at once.
    input_grads_first: with serial_stages, each stage's backward pass
      computes the gradient it sends to the stage before it first and its
      weight gradients after (zero-bubble pipelines' B-before-W order): the
      stage before starts its backward pass sooner, which shrinks the
      bubble below GPipe's. Off: each backward pass in creation order.
    copies: data x pipeline: R-1 more copies of the pipeline, each a
      `(stages, model, optimizer)` on its own devices (same layers and
      initial weights as `stages`; `optimizer` of the same config, not yet
      built). Copy r trains on the r-th consecutive share of the global
      batch; each stage's gradients are summed across the R copies and
      every copy applies the same update. Only `model` and `optimizer` are
      checkpointed; the copies are set from them before each `train` call.
    shard_optimizer_state: with copies, copy r keeps and updates 1/R of
      every variable's optimizer slots (`copy_sharding`, ZeRO-1 on the data
      axis); checkpoints still hold the full slots. One copy: no change.
    **kwargs: `Trainer` arguments (global_batch_size, loss_fn, ...).
  """

  def __init__(self, model, optimizer, strategy, *, stages,
               num_microbatches=default(SplitConfig, "num_microbatches"),
               recompute=default(SplitConfig, "recompute"),
               serial_stages=default(SplitConfig, "serial_stages"),
               input_grads_first=default(SplitConfig, "input_grads_first"),
               copies=(), shard_optimizer_state=False, **kwargs):
    check_positive("num_microbatches", num_microbatches)
    if strategy.num_replicas_in_sync != 1:
      raise ConfigError(
          f"model parallelism needs a strategy with one replica (default or "
          f"one_device); this one has {strategy.num_replicas_in_sync}")
    batch = kwargs.get("global_batch_size")
    copies = list(copies)
    replicas = len(copies) + 1
    if batch and batch % num_microbatches:
      raise ConfigError(
          f"num_microbatches={num_microbatches} does not divide "
          f"global_batch_size={batch}; use a divisor of {batch}")
    if batch and batch % (num_microbatches * replicas):
      raise ConfigError(
          f"num_microbatches={num_microbatches} does not divide each "
          f"pipeline copy's share of global_batch_size={batch} ({replicas} "
          f"copies); use a global batch that is a multiple of "
          f"{num_microbatches * replicas}")
    if model.losses:
      # Regularisation terms would need their own per-stage tapes.
      raise ConfigError(
          "model parallelism does not support layer regularisation losses "
          "yet; remove the regularisers (use optimizer=adamw for weight "
          "decay)")
    self.stages = list(stages)
    self.num_microbatches = num_microbatches
    self.recompute = bool(recompute)
    self.streams = DeviceStreams(enabled=serial_stages)
    self.input_grads_first = bool(input_grads_first)
    self.stage_variables = [s.trainable_variables for s in self.stages]
    staged = [id(v) for vs in self.stage_variables for v in vs]
    if (len(staged) != len(set(staged)) or
        set(staged) != {id(v) for v in model.trainable_variables}):
      raise ValueError("the stages must use each trainable variable of the "
                       "model exactly once")
    self.copy_sharding = None
    if shard_optimizer_state and copies:
      # Builds every copy's optimizer on its shards; Trainer's
      # `optimizer.build` is then a no-op (Keras builds once).
      self.copy_sharding = CopyShardedState(
          [optimizer] + [o for _, _, o in copies],
          [model] + [m for _, m, _ in copies], strategy)
    elif shard_optimizer_state:
      logging.info("shard_optimizer_state: one copy of the split (no data "
                   "axis), nothing to shard")
    super().__init__(model, optimizer, strategy, **kwargs)
    self._set_up_copies(copies)
    self.memory = memory_by_device(model, optimizer)
    add_activations(self.memory, self.stages, self.global_batch_size,
                    self.recompute)
    logging.info("model-parallel memory per device: %s",
                 format_memory(self.memory))

  @property
  def checkpointed_optimizer(self):
    """The optimizer, or with the state sharded over the copies a view of
    it that saves each slot whole (the keys of the unsharded run)."""
    if self.copy_sharding is None:
      return self.optimizer
    return self.copy_sharding.checkpointed_optimizer

  @property
  def variables(self):
    """The trainable variables in stage order (the order of the gradients)."""
    return [v for vs in self.stage_variables for v in vs]

  def forward(self, features, training=False):
    """The model's outputs, each stage on its device (no tape)."""
    x = features
    for stage in self.stages:
      x = stage.apply(x, training)
    return x

  def gradients(self, features, labels):
    """(gradients in `self.variables` order, loss, accuracy) of one batch.

    The micro-batched, device-pinned forward and backward passes; the
    gradient is that of the mean loss over `global_batch_size` examples.
    With copies (data x pipeline): copy 0's, already summed over copies.
    """
    if self.copies:
      grads, loss, accuracy = self._copies_gradients(features, labels)
      return grads[0], loss, accuracy
    grads, loss, accuracy = self._pipeline_gradients(self.stages, features,
                                                     labels)
    return [g for stage_grads in grads for g in stage_grads], loss, accuracy

  def _pipeline_gradients(self, stages, features, labels):
    """(a gradient list per stage, loss, accuracy): one pipeline's pass."""
    last = len(stages) - 1
    with tf.device(stages[0].device):
      micro_features = tf.split(features, self.num_microbatches)
    with tf.device(stages[last].device):
      micro_labels = tf.split(labels, self.num_microbatches)

    # A device runs its forward passes one micro-batch at a time, in order
    # (as a GPU stream would; logical CPU devices would otherwise run them
    # all at once on the shared cores).
    previous = [[] for _ in stages]

    # Forward, all micro-batches: each stage keeps its tapes for backward
    # (with recompute: only its inputs).
    records, losses, accuracies = [], [], []
    for x, y in zip(micro_features, micro_labels):
      # Divide by the GLOBAL batch size, so the M shares sum to the mean.
      head = lambda logits, y=y: self.average(self.loss_fn(y, logits))
      micro_records = []
      for i, stage in enumerate(stages):
        with self.streams.on(_stream_key(stage)):
          x, record = stage.forward(x, training=True, after=previous[i],
                                    head=head if i == last else None,
                                    recompute=self.recompute)
        previous[i] = tf.nest.flatten(x)
        micro_records.append(record)
      records.append(micro_records)
      losses.append(micro_records[last].target)
      with tf.device(stages[last].device):
        accuracies.append(self.average(self.correct(y, x)))

    # Backward, last micro-batch first; gradients summed on each device.
    grads = [None] * len(stages)
    for micro_records in reversed(records):
      output_grad = None
      for i in reversed(range(len(stages))):
        stage = stages[i]
        # No `after` here: control inputs in the backward pass change
        # Grappler's rewrites of the gradient ops (results then differ from
        # the unsplit model in the last bits); data dependencies already
        # order each micro-batch's backward stage by stage.
        with self.streams.on(_stream_key(stage)) as block:
          output_grad, stage_grads = stage.backward(
              micro_records[i], output_grad, input_grad=i > 0)
          grads[i] = self._accumulate(stage, grads[i], stage_grads)
          if self.input_grads_first:
            # The stage before waits for this; the weight gradients do not.
            block.first(output_grad)
    return grads, tf.add_n(losses), tf.add_n(accuracies)

  def train_step(self, batch):
    features, labels = batch
    if self.copies:
      return self._copies_train_step(features, labels)
    grads, loss, accuracy = self.gradients(features, labels)
    # One update with the full-batch gradient, as the unsplit model does.
    grads, grad_norm = self.clip_by_global_norm(grads)
    self.apply_gradients(grads, self.variables)
    return {"loss": loss, "accuracy": accuracy,
            "grad_norm": self.replica_share(grad_norm)}

  def update_variable(self, grad, var, learning_rate):
    """Runs each variable's optimizer math on that variable's device.

    Unplaced ops go to device 0; without this, stage 1's Adam arithmetic
    would run there and copy its results back.
    """
    device = variable_device(var)
    optimizer = self._copy_optimizers.get(id(tf_variable(var)))
    with tf.device(device), tf.name_scope(update_scope(device) + "/"):
      if optimizer is None:
        return super().update_variable(grad, var, learning_rate)
      # A copy's variable: its own slots, the same step and learning rate.
      main, self.optimizer = self.optimizer, optimizer
      try:
        return super().update_variable(grad, var, learning_rate)
      finally:
        self.optimizer = main

  def _accumulate(self, stage, totals, grads):
    """totals + grads, each sum on its variable's device."""
    if totals is None:
      return list(grads)
    summed = []
    for leaf in stage.leaves:
      with tf.device(leaf.device), tf.name_scope(f"{leaf.name}/accumulate/"):
        for _ in leaf.trainable_variables:
          summed.append(_add(totals[len(summed)], grads[len(summed)]))
    return summed

  def eval_logits(self, features):
    """The placed forward pass (no test-time augmentation under a split)."""
    return self.forward(features, training=False)

  def train(self, iterator, num_steps):
    """As `Trainer.train`, plus each device's memory as extra scalars."""
    if self.copies:
      self.sync_copies()
    metrics = dict(super().train(iterator, num_steps))
    metrics.update(memory_metrics(self.memory))
    return metrics


def _add(total, grad):
  """total + grad; two IndexedSlices (an embedding lookup's gradient, one per
  micro-batch) concatenate, as a sum of sparse gradients does (`+` is not
  defined for them)."""
  if isinstance(total, tf.IndexedSlices) and isinstance(grad, tf.IndexedSlices):
    return tf.IndexedSlices(tf.concat([total.values, grad.values], 0),
                            tf.concat([total.indices, grad.indices], 0),
                            total.dense_shape)
  return tf.convert_to_tensor(total) + tf.convert_to_tensor(grad)
