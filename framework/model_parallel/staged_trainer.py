"""A Trainer whose step runs a model as device-pinned stages, GPipe-style.

A stage is a piece of the model pinned to one device, forward AND backward.
`tf.GradientTape` does not put gradient ops next to their forward ops: they
land wherever the `tape.gradient` call happens (device 0 by default). So each
piece records its forward pass on its own tape, under its own device, and
computes its backward pass from that tape under the same device:

    forward:  x_i   = identity(x)                 # receive on device i
              y     = layers_i(x_i)               # recorded on tape_i
    backward: dx_i, dW_i = tape_i.gradient(y, [x_i, W_i], dy)   # on device i

A `Stage` is a run of layers on one device (a pipeline stage); a
`ParallelStage` is several stages on different devices that read the same
input and whose outputs are summed (tensor parallelism). Ops are named
`<stage name>/...` (backward: `gradient_tape/<stage name>/...`) so that tests
can find every op of a piece in the traced graph.

`StagedTrainer`, the trainer `PipelineTrainer` and `TensorParallelTrainer`
derive from, runs one step on a global batch of B examples cut into M
micro-batches of B/M:

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
`copies.PipelineCopies`.

Recomputation (`recompute=True`, GPipe's re-materialisation): the forward
pass keeps no tape, only the piece's input (and a copy of its layers' state:
BatchNorm statistics, dropout seed counters); the backward pass re-runs the
forward on a fresh tape from that input and state, then takes the gradient.
The state is put back afterwards, so the step updates BatchNorm statistics
and draws dropout masks exactly as without recomputation.

Checkpoints, summaries and the Controller are unchanged: the model is still
one Keras model whose variables happen to live on several devices.
"""

import collections

from absl import logging
import numpy as np
import tensorflow as tf

from framework import _tf_internal
from framework.core.config import TrainerConfig, check_gradient_sharding
from framework.core.trainer import Trainer
from framework.errors import ConfigError, check_positive
from framework.model_parallel.config import SplitConfig, parse_recompute
from framework.model_parallel.copies import PipelineCopies, tf_variable
from framework.model_parallel.copy_parameter_sharding import (
    CopyParameterSharding, StageShards, place_on_host, release)
from framework.core import updates, weight_decay
from framework.core.optimizer_sharding import CopyShardedState
from framework.model_parallel.devices import (DeviceStreams, add_activations,
                                              format_memory, memory_by_device,
                                              memory_metrics, variable_device)
from framework.settings import default


# What a forward pass keeps for its backward pass. With recomputation:
# tape None, `state` the layers' state before the pass, `head` the loss.
# `weights`: with the weights joined from shards (ZeRO-3 on the data
# axis), each variable's R shard tensors, which the tape watches instead
# of the variables (their gradients are the slices of the variable's).
Record = collections.namedtuple(
    "Record",
    ["tape", "inputs", "target", "state", "head", "training", "weights"],
    defaults=(None, None, True, None))


def state_variables(layers):
  """The non-trainable variables of `layers` (BatchNorm stats, seeds)."""
  seen, variables = set(), []
  for layer in layers:
    for v in getattr(layer, "non_trainable_variables", ()):
      if id(v) not in seen:
        seen.add(id(v))
        variables.append(v)
  return variables


def read_state(variables):
  """The current values of `variables` (read in program order)."""
  return [tf.identity(v.value) for v in variables]


class restored_state:  # pylint: disable=invalid-name
  """Sets `variables` to `values` inside the block, then back as they were.

  The recomputed forward pass then sees the state of the original pass
  (same dropout masks) and leaves no trace in it (no second BatchNorm
  update). Variable ops run in program order inside a `tf.function`.
  """

  def __init__(self, variables, values):
    self.variables, self.values = variables, values

  def __enter__(self):
    self.current = read_state(self.variables)
    for v, value in zip(self.variables, self.values):
      v.assign(value)

  def __exit__(self, *exc):
    for v, value in zip(self.variables, self.current):
      v.assign(value)


def tensor_bytes(tensor):
  """Bytes per example of a symbolic (Keras) tensor: shape[1:] x dtype."""
  return int(np.prod(tensor.shape[1:])) * tf.as_dtype(tensor.dtype).size


class Stage:
  """`layers` run in order on `device`.

  Args:
    name: a name scope for the ops (e.g. `stage_1`).
    device: e.g. `/CPU:1` or `/GPU:1`.
    layers: callables (Keras layers) applied in order.
  """

  # ZeRO-3 on the data axis: a `copy_parameter_sharding.StageShards` whose
  # gathered weights the layers run on (set by the trainer).
  shards = None

  def __init__(self, name, device, layers):
    self.name = name
    self.device = device
    self.layers = list(layers)

  @property
  def trainable_variables(self):
    return [v for layer in self.layers for v in layer.trainable_variables]

  @property
  def leaves(self):
    """The single-device stages this stage consists of: itself."""
    return [self]

  def _call(self, x, training):
    for layer in self.layers:
      if self.shards is None:
        x = layer(x, training=training)
      else:  # ZeRO-3: a layer's weights joined per call
        x = self.shards.call(layer, layer, (x,), {"training": training})
    return x

  def apply(self, x, training=False):
    """The forward pass on `device`, not recorded (evaluation)."""
    with tf.device(self.device), tf.name_scope(self.name + "/"):
      return self._call(tf.identity(x), training)

  def forward(self, x, training=True, head=None, after=(),
              recompute=default(SplitConfig, "recompute")):
    """(outputs, record): the forward pass on `device`, recorded.

    Args:
      x: the input (from another device, or the batch).
      training: passed to the layers.
      head: optional `outputs -> scalar` (the loss) computed on this device
        and on this tape; `record.target` is then that scalar.
      after: tensors that must exist before this pass starts (the device's
        previous work: one micro-batch at a time).
      recompute: keep only `x` (and the layers' state); `backward` runs
        the forward pass again.
    """
    with tf.device(self.device), tf.name_scope(self.name + "/"):
      # One copy onto this device, instead of one per consuming op. Only
      # this op waits for `after`: control inputs on the layers' ops would
      # stop Grappler from fusing them (and change the float results).
      with tf.control_dependencies(after):
        x = tf.identity(x)
      if recompute:
        state = read_state(state_variables(self.layers))
        outputs = self._run_layers(lambda: self._call(x, training), [x])
        target = head(outputs) if head is not None else outputs
        return outputs, Record(None, x, target, state, head, training)
      with tf.GradientTape() as tape:
        tape.watch(x)
        outputs, weights = self._run_layers(
            lambda: self._call(x, training), [x], tape, keep_writes=True)
        target = head(outputs) if head is not None else outputs
    return outputs, Record(tape, x, target, weights=weights)

  def _run_layers(self, fn, after, tape=None, keep_writes=None):
    """fn(): the layers on their variables, or with `shards` on weights
    joined from them where read, after `after` (`StageShards.run`); with
    a `tape`, (outputs, the shard tensors the tape watches, or None)."""
    if self.shards is None:
      return fn() if tape is None else (fn(), None)
    outputs, weights = self.shards.run(fn, after, tape, keep_writes)
    return outputs if tape is None else (outputs, weights)

  def backward(self, record, output_grad, input_grad=True, after=()):
    """(d input, [d variable]) on `device`, from the forward `record`.

    Args:
      record: what `forward` returned.
      output_grad: d loss / d outputs (None when the target is the loss).
      input_grad: False skips d input (the first stage's input is data).
      after: tensors that must exist before this pass starts.
    """
    variables = self.trainable_variables
    with tf.device(self.device), tf.name_scope(self.name + "/"):
      if output_grad is None:
        output_grad = tf.ones_like(record.target)  # d loss / d loss
      with tf.control_dependencies(after):
        output_grad = tf.identity(output_grad)
      if record.tape is None:
        record = self._recompute(record, output_grad)
      if record.weights is not None:
        variables = record.weights
      sources = ([record.inputs] if input_grad else []) + variables
      grads = record.tape.gradient(
          record.target, sources, output_gradients=output_grad,
          unconnected_gradients=tf.UnconnectedGradients.ZERO)
    if not input_grad:
      return None, grads
    return grads[0], grads[1:]

  def _recompute(self, record, output_grad):
    """The record `forward` would have kept, by running it again."""
    # Waiting for the output gradient starts the recomputation in the
    # backward pass (and keeps Grappler from merging it with the forward).
    with tf.control_dependencies([output_grad]):
      x = tf.identity(record.inputs)
    with restored_state(state_variables(self.layers), record.state):
      with tf.GradientTape() as tape:
        tape.watch(x)
        outputs, weights = self._run_layers(
            lambda: self._call(x, record.training), [x], tape)
        target = record.head(outputs) if record.head is not None else outputs
    return Record(tape, x, target, weights=weights)

  def activation_bytes(self,
                       recompute=default(SplitConfig, "recompute")):
    """Bytes per example this stage keeps for its backward pass.

    From the static shapes: its input and every layer's output (with
    `recompute`: its input only). None if a layer was never called on a
    symbolic input, or the stage has no Keras layers (a tensor shard).
    """
    if not self.layers:
      return None
    try:
      tensors = [self.layers[0].input] + (
          [] if recompute else [layer.output for layer in self.layers])
    except (AttributeError, ValueError):
      return None
    return sum(tensor_bytes(t) for t in tf.nest.flatten(tensors))


class ParallelStage:
  """Stages on several devices that share one input; outputs are summed.

  The sum (and the sum of the input gradients) runs on `device`, where the
  next stage reads it.
  """

  def __init__(self, name, device, branches):
    self.name = name
    self.device = device
    self.branches = list(branches)

  @property
  def trainable_variables(self):
    return [v for branch in self.branches for v in branch.trainable_variables]

  @property
  def leaves(self):
    return list(self.branches)

  def _sum(self, tensors, what):
    with tf.device(self.device), tf.name_scope(f"{self.name}/{what}/"):
      return tf.add_n(tensors)

  def apply(self, x, training=False):
    return self._sum([b.apply(x, training) for b in self.branches], "sum")

  def forward(self, x, training=True, head=None, after=(),
              recompute=default(SplitConfig, "recompute")):
    if head is not None:
      raise ValueError("a ParallelStage cannot compute the loss; end the "
                       "model with a Stage")
    outputs, records = zip(*(b.forward(x, training, after=after,
                                       recompute=recompute)
                             for b in self.branches))
    return self._sum(list(outputs), "sum"), records

  def backward(self, records, output_grad, input_grad=True, after=()):
    # The gradient of a sum is the same output_grad for every branch.
    input_grads, variable_grads = [], []
    for branch, record in zip(self.branches, records):
      dx, grads = branch.backward(record, output_grad, input_grad, after)
      input_grads.append(dx)
      variable_grads.extend(grads)
    if not input_grad:
      return None, variable_grads
    return self._sum(input_grads, "sum_input_grads"), variable_grads


def _stream_key(stage):
  """A one-device stage's device; None for one spread over several."""
  leaves = stage.leaves
  return stage.device if len(leaves) == 1 and leaves[0] is stage else None


def update_scope(device):
  """The name scope of the optimizer updates on `device` (`update_CPU_1`)."""
  return "update_" + device.strip("/").replace(":", "_")


class StagedTrainer(PipelineCopies, Trainer):
  """Trains a model given as device-pinned stages (`Stage`).

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
      order, as a GPU stream would (`devices.DeviceStreams`); by default
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
      every variable's optimizer slots (`optimizer_sharding.CopyShardedState`, ZeRO-1 on the data
      axis); checkpoints still hold the full slots. One copy: no change.
    shard_gradients: with `shard_optimizer_state` and copies, each stage's
      gradients are reduce-scattered over the copies (under
      `grad_accum_steps` each accumulation step's), so copy r accumulates
      and updates with its 1/R slice only (ZeRO-2 on the data axis).
    shard_parameters: with `shard_gradients` and copies, copy r keeps only
      its 1/R of every weight (ZeRO-3 on the data axis,
      `copy_parameter_sharding`): each layer call (a transformer split:
      each of its placed blocks) joins the weights it reads from the
      copies' shards on its device, forward and again in its backward
      pass; the model's variables keep the whole weights outside the
      step. None (not given): off, as the setting's default.
    **kwargs: `Trainer` arguments (global_batch_size, loss_fn, ...).
  """

  # Whether the model's layers run their own placed blocks
  # (`parallel_layers.on_device`: a transformer split). ZeRO-3 on the data
  # axis joins the weights in those; else it runs each layer call with
  # weights as one block on its stage's device.
  layers_place_blocks = False

  # Its own step accumulates: `grad_accum_steps` whole pipeline passes.
  train_step_handles = ("grad_accum_steps",)

  def __init__(self, model, optimizer, strategy, *, stages,
               num_microbatches=default(SplitConfig, "num_microbatches"),
               recompute=default(SplitConfig, "recompute"),
               serial_stages=default(SplitConfig, "serial_stages"),
               input_grads_first=default(SplitConfig, "input_grads_first"),
               copies=(), shard_parameters=None,
               shard_optimizer_state=default(TrainerConfig,
                                             "shard_optimizer_state"),
               **kwargs):
    check_positive("num_microbatches", num_microbatches)
    if kwargs.get("loss_scale") is not None:
      # Said here, not by `Trainer`'s check of train_step overrides (which
      # would advise a user who wrote no trainer to override compute_loss).
      raise ConfigError(
          "mixed_precision=float16 (dynamic loss scaling) is not supported "
          "with a model split; use mixed_precision=bfloat16 (no loss scale) "
          "or float32")
    spike_policy = kwargs.get("spike_policy",
                              default(TrainerConfig, "spike_policy"))
    if spike_policy != "none":
      # The copies' sharded updates would drop the spike signals silently.
      raise ConfigError(
          f"spike_policy={spike_policy} is not supported with a model split "
          "(a split's step applies its update without the spike check); "
          "use --spike_policy=none")
    # Not `Trainer`'s: the copies' sharding is this trainer's own.
    shard_gradients = kwargs.pop("shard_gradients",
                                 default(TrainerConfig, "shard_gradients"))
    check_gradient_sharding(shard_gradients, shard_optimizer_state,
                            kwargs.get("all_reduce"))
    if strategy.num_replicas_in_sync != 1:
      raise ConfigError(
          f"model parallelism needs a strategy with one replica (default or "
          f"one_device); this one has {strategy.num_replicas_in_sync}")
    batch = kwargs.get("global_batch_size")
    copies = list(copies)
    replicas = len(copies) + 1
    accum = kwargs.get("grad_accum_steps",
                       default(TrainerConfig, "grad_accum_steps"))
    if batch and batch % num_microbatches:
      raise ConfigError(
          f"num_microbatches={num_microbatches} does not divide "
          f"global_batch_size={batch}; use a divisor of {batch}")
    if batch and batch % (num_microbatches * replicas * accum):
      parts = (f"{replicas} copies" if accum == 1 else
               f"{replicas} copies, grad_accum_steps={accum}")
      raise ConfigError(
          f"num_microbatches={num_microbatches} does not divide each "
          f"pipeline copy's share of global_batch_size={batch} ({parts}); "
          f"use a global batch that is a multiple of "
          f"{num_microbatches * replicas * accum}")
    if model.losses:
      # Regularisation terms would need their own per-stage tapes.
      raise ConfigError(
          "model parallelism does not support layer regularisation losses "
          "yet; remove the regularisers (use optimizer=adamw for weight "
          "decay)")
    if shard_parameters:
      _check_parameter_sharding(copies, recompute, shard_optimizer_state,
                                shard_gradients, kwargs)
    self.stages = list(stages)
    self.num_microbatches = num_microbatches
    # Only `True` recomputes whole stages; blocks, attention are the layers'.
    self.recompute = parse_recompute(recompute) is True
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
    self._shard_copy_gradients = bool(shard_gradients and copies)
    self.parameter_sharding = None
    self._shards_parameters = bool(shard_parameters)
    super().__init__(model, optimizer, strategy, **kwargs)
    self._set_up_copies(copies)
    self._group_copies_weight_decay()
    if shard_parameters:
      self._shard_copy_parameters()
    if self._shard_copy_gradients and self.copy_sharding is not None:
      state = self.copy_sharding
      logging.info(
          "shard_gradients: each copy accumulates and updates with %d of "
          "the gradient's %d bytes (ZeRO-2 over %d copies)",
          sum(s.shape[0] * tf.as_dtype(s.dtype).size for s in state.shards[0]),
          sum(tf.TensorShape(v.shape).num_elements()
              * tf.as_dtype(v.dtype).size for v in state.variables[0]),
          state.num_shards)
    self.memory = memory_by_device(model, optimizer)
    add_activations(self.memory, self.stages, self.global_batch_size,
                    self.recompute)
    logging.info("model-parallel memory per device: %s",
                 format_memory(self.memory))

  def _make_updater(self, **parts):
    """With the optimizer state sharded over the copies, the copies' ZeRO-1
    update (`updates.CopyShardedUpdate`); else the `Trainer`'s."""
    if self.copy_sharding is not None:
      kind = (updates.CopyShardedGradientsUpdate
              if self._shard_copy_gradients else updates.CopyShardedUpdate)
      if getattr(self, "_shards_parameters", False):
        kind = updates.CopyShardedParametersUpdate
      return kind(self.strategy, sharding=self.copy_sharding, **parts)
    return super()._make_updater(**parts)

  def _shard_copy_parameters(self):
    """Every stage of every copy runs on weights joined from the copies'
    shards (`copy_parameter_sharding`)."""
    state = self.copy_sharding
    # Copy 0's whole weights: read by checkpoints, evaluation and export
    # only, so on its devices' host (as the model's host copy under a
    # mirrored strategy), not beside its shards.
    for variable in state.variables[0]:
      place_on_host(variable)
    state.reindex()
    all_stages = [self.stages] + [stages for stages, _, _ in self.copies]
    for r, stages in enumerate(all_stages):
      for stage in stages:
        stage.shards = StageShards(
            state, r, stage.trainable_variables,
            state_variables(stage.layers),
            layer_device=None if self.layers_place_blocks else stage.device)
    self.parameter_sharding = CopyParameterSharding(state)
    # Copies 1..R-1's whole weights: read by nothing now (the step reads
    # the shards; checkpoints, evaluation and export copy 0's).
    for _, model, _ in self.copies:
      for variable in model.trainable_variables:
        release(variable)
    logging.info(
        "shard_parameters: each copy keeps %d of its %d bytes of weights "
        "(ZeRO-3 over %d copies); each layer call joins the weights it "
        "reads, forward and again backward; copy 0's whole weights on %s",
        sum(s.shape[0] * tf.as_dtype(s.dtype).size for s in state.shards[0]),
        sum(tf.TensorShape(v.shape).num_elements()
            * tf.as_dtype(v.dtype).size for v in state.variables[0]),
        state.num_shards,
        ", ".join(sorted({tf_variable(v).device for v in state.variables[0]})))

  def _group_copies_weight_decay(self):
    """Every copy's optimizer (and the shards of each) decays the
    variables copy 0's decays (grouped by `Trainer`)."""
    main = self.optimizer
    decided = lambda variables: [_tf_internal.uses_weight_decay(main, v)
                                 for v in variables]
    if self.copy_sharding is not None:
      state = self.copy_sharding
      decisions = decided(state.variables[0])
      for optimizer, shards, variables in zip(
          state.optimizers, state.shards, state.variables):
        weight_decay.group(optimizer, variables, decisions=decisions,
                           followers=[shards])
      return
    decisions = decided(self.variables)
    for stages, _, optimizer in self.copies:
      weight_decay.group(
          optimizer, [v for s in stages for v in s.trainable_variables],
          decisions=decisions)

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
    steps = self.grad_accum_steps
    if steps == 1:
      grads, loss, accuracy = self._pipeline_gradients(self.stages, features,
                                                       labels)
      return [g for stage_grads in grads for g in stage_grads], loss, accuracy
    # K consecutive parts, one after another, each a whole pipeline pass.
    totals, losses, accuracies = None, [], []
    for x, y in zip(tf.split(features, steps), tf.split(labels, steps)):
      if totals is not None:
        with tf.control_dependencies(tf.nest.flatten(totals,
                                                     expand_composites=True)):
          x = tf.identity(x)
      grads, loss, accuracy = self._pipeline_gradients(self.stages, x, y)
      totals = grads if totals is None else [
          self._accumulate(stage, total, stage_grads)
          for stage, total, stage_grads in zip(self.stages, totals, grads)]
      losses.append(loss)
      accuracies.append(accuracy)
    with tf.device(self.stages[-1].device):
      return ([g for stage_grads in totals for g in stage_grads],
              tf.add_n(losses), tf.add_n(accuracies))

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
    if self.parameter_sharding is None:
      metrics = dict(super().train(iterator, num_steps))
    else:
      # The step trains the shards; copy 0's variables are the whole
      # weights everything else reads.
      self.parameter_sharding.load()
      try:
        metrics = dict(super().train(iterator, num_steps))
      finally:
        self.parameter_sharding.store()
    metrics.update(memory_metrics(self.memory))
    return metrics


def _check_parameter_sharding(copies, recompute, shard_optimizer_state,
                              shard_gradients, kwargs):
  """ConfigError for what ZeRO-3 on the data axis cannot go with."""
  for name, value in (("shard_optimizer_state", shard_optimizer_state),
                      ("shard_gradients", shard_gradients)):
    if not value:
      raise ConfigError(
          f"shard_parameters=True needs {name}=True (ZeRO-3 shards the "
          f"weights of ZeRO-1 and 2's sharded update); add --{name}")
  if not copies:
    raise ConfigError(
        "shard_parameters=True shards the weights over a split's copies; "
        "this split has one (use a mesh with a data axis, e.g. "
        "--mesh=data:2,pipeline:2)")
  value = parse_recompute(recompute)
  if value not in (False, True):
    raise ConfigError(
        f"shard_parameters=True runs each block again in the backward "
        f"pass (it joins its weights again there); recompute={value} is "
        f"not supported with it: use --recompute=none or true")
  for name, off, what in (
      ("ema_decay", None, "an EMA of the whole weights"),
      ("log_layer_norms", False, "per-layer norms of the whole weights"),
      ("jit_compile", False, "XLA around the joined weights")):
    if kwargs.get(name, off) != off:
      raise ConfigError(
          f"shard_parameters=True does not support {name}={kwargs[name]} "
          f"({what} inside the step); turn {name} off")


def _add(total, grad):
  """total + grad; two IndexedSlices (an embedding lookup's gradient, one per
  micro-batch) concatenate, as a sum of sparse gradients does (`+` is not
  defined for them); ZeRO-3's slices (tuples) slice by slice, each where
  it is."""
  if isinstance(total, tuple):
    summed = []
    for t, g in zip(total, grad):
      with tf.device(t.device):
        summed.append(_add(t, g))
    return tuple(summed)
  if isinstance(total, tf.IndexedSlices) and isinstance(grad, tf.IndexedSlices):
    return tf.IndexedSlices(tf.concat([total.values, grad.values], 0),
                            tf.concat([total.indices, grad.indices], 0),
                            total.dense_shape)
  return tf.convert_to_tensor(total) + tf.convert_to_tensor(grad)
