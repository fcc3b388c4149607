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
while stage i+1 works on micro-batch m (the GPipe schedule; see BUILD.md).

Checkpoints, summaries and the Controller are unchanged: the model is still
one Keras model whose variables happen to live on several devices.
"""


from absl import logging
import tensorflow as tf

from framework.errors import ConfigError, check_positive
from framework.model_parallel.devices import variable_device
from framework.model_parallel.memory import (add_activations, format_memory,
                                             memory_by_device, memory_metrics)
from framework.core.trainer import Trainer


def update_scope(device):
  """The name scope of the optimizer updates on `device` (`update_CPU_1`)."""
  return "update_" + device.strip("/").replace(":", "_")


class StagedTrainer(Trainer):
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
    **kwargs: `Trainer` arguments (global_batch_size, loss_fn, ...).
  """

  def __init__(self, model, optimizer, strategy, *, stages,
               num_microbatches=1, recompute=False, **kwargs):
    check_positive("num_microbatches", num_microbatches)
    if strategy.num_replicas_in_sync != 1:
      raise ConfigError(
          f"model parallelism needs a strategy with one replica (default or "
          f"one_device); this one has {strategy.num_replicas_in_sync}")
    batch = kwargs.get("global_batch_size")
    if batch and batch % num_microbatches:
      raise ConfigError(
          f"num_microbatches={num_microbatches} does not divide "
          f"global_batch_size={batch}; use a divisor of {batch}")
    if model.losses:
      # Regularisation terms would need their own per-stage tapes.
      raise ConfigError(
          "model parallelism does not support layer regularisation losses "
          "yet; remove the regularisers (use optimizer=adamw for weight "
          "decay)")
    self.stages = list(stages)
    self.num_microbatches = num_microbatches
    self.recompute = bool(recompute)
    self.stage_variables = [s.trainable_variables for s in self.stages]
    staged = [id(v) for vs in self.stage_variables for v in vs]
    if (len(staged) != len(set(staged)) or
        set(staged) != {id(v) for v in model.trainable_variables}):
      raise ValueError("the stages must use each trainable variable of the "
                       "model exactly once")
    super().__init__(model, optimizer, strategy, **kwargs)
    self.memory = memory_by_device(model, optimizer)
    add_activations(self.memory, self.stages, self.global_batch_size,
                    self.recompute)
    logging.info("model-parallel memory per device: %s",
                 format_memory(self.memory))

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
    """
    last = len(self.stages) - 1
    with tf.device(self.stages[0].device):
      micro_features = tf.split(features, self.num_microbatches)
    with tf.device(self.stages[last].device):
      micro_labels = tf.split(labels, self.num_microbatches)

    # A device runs its forward passes one micro-batch at a time, in order
    # (as a GPU stream would; logical CPU devices would otherwise run them
    # all at once on the shared cores).
    previous = [[] for _ in self.stages]

    # Forward, all micro-batches: each stage keeps its tapes for backward
    # (with recompute: only its inputs).
    records, losses, accuracies = [], [], []
    for x, y in zip(micro_features, micro_labels):
      # Divide by the GLOBAL batch size, so the M shares sum to the mean.
      head = lambda logits, y=y: self.average(self.loss_fn(y, logits))
      micro_records = []
      for i, stage in enumerate(self.stages):
        x, record = stage.forward(x, training=True, after=previous[i],
                                  head=head if i == last else None,
                                  recompute=self.recompute)
        previous[i] = tf.nest.flatten(x)
        micro_records.append(record)
      records.append(micro_records)
      losses.append(micro_records[last].target)
      with tf.device(self.stages[last].device):
        accuracies.append(self.average(self.correct(y, x)))

    # Backward, last micro-batch first; gradients summed on each device.
    grads = [None] * len(self.stages)
    for micro_records in reversed(records):
      output_grad = None
      for i in reversed(range(len(self.stages))):
        stage = self.stages[i]
        # No `after` here: control inputs in the backward pass change
        # Grappler's rewrites of the gradient ops (results then differ from
        # the unsplit model in the last bits); data dependencies already
        # order each micro-batch's backward stage by stage.
        output_grad, stage_grads = stage.backward(
            micro_records[i], output_grad, input_grad=i > 0)
        grads[i] = self._accumulate(stage, grads[i], stage_grads)
    grads = [g for stage_grads in grads for g in stage_grads]
    return grads, tf.add_n(losses), tf.add_n(accuracies)

  def train_step(self, batch):
    features, labels = batch
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
    with tf.device(device), tf.name_scope(update_scope(device) + "/"):
      return super().update_variable(grad, var, learning_rate)

  def _accumulate(self, stage, totals, grads):
    """totals + grads, each sum on its variable's device."""
    if totals is None:
      return list(grads)
    summed = []
    for leaf in stage.leaves:
      with tf.device(leaf.device), tf.name_scope(f"{leaf.name}/accumulate/"):
        for _ in leaf.trainable_variables:
          summed.append(totals[len(summed)] + grads[len(summed)])
    return summed

  def eval_logits(self, features):
    """The placed forward pass (no test-time augmentation under a split)."""
    return self.forward(features, training=False)

  def train(self, iterator, num_steps):
    """As `Trainer.train`, plus each device's memory as extra scalars."""
    metrics = dict(super().train(iterator, num_steps))
    metrics.update(memory_metrics(self.memory))
    return metrics
