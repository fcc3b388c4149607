"""ZeRO-3 (`--shard_parameters`): each replica holds 1/N of every weight.

ZeRO-1 (`framework.core.optimizer_sharding`) gives replica r the shard
variables `w_r` (the [L]-element slice r of each flattened, zero-padded
weight) and the optimizer's slots of them; ZeRO-2 keeps only the
reduce-scattered slice of the gradient. With `shard_parameters` the shards
are the weights the step trains. The model's top-level layers run in units
(one layer, or `--recompute=every:K` runs of K); each unit

    W = all_gather(w_r)              # its layers' weights, whole, when
                                     # the unit's inputs exist
    y = unit(x; W)                   # the layers read W (keras.StatelessScope)
                                     # and W is dropped after the unit
    backward: W = all_gather(w_r)    # gathered again: the unit is
              dx, dW = grad(unit)    # recomputed (`recompute.recomputed`),
              g_r = reduce_scatter(dW)   # the gather's gradient

so a device holds, besides its 1/N of the weights, gradients and slots,
the weights of one unit at a time (two when a unit's backward pass
overlaps the next one's gathering). The update is ZeRO-1's on the shards
(`updates.ShardedParametersUpdate`), with no all-gather after it.

The model's own variables keep the whole weights for everything outside
the step: checkpoints (their keys as an unsharded run writes them, so a
run resumes with sharding on or off and on another replica count),
evaluation, export and the summaries. They are written from the shards
when `train` returns (one all-gather per loop of `steps_per_loop` steps,
not per step), and the shards are cut from them again when `train` starts
(after a restore, a rollback or a warm start).

Units are the top-level layers of a functional or Sequential model (the
GPT's embedding, blocks, final norm and tied head). A layer used by two
units (the GPT's tied embedding) is gathered by each. Weight regularisers
(a layer's `kernel_regularizer`), an EMA of the weights, per-layer norm
logging and XLA are refused: each reads the whole weights inside the step.
"""

from __future__ import annotations

import contextlib
import threading

import keras
import tensorflow as tf

from framework import _tf_internal
from framework.core import optimizer_sharding
from framework.core import updates
from framework.errors import ConfigError
from framework.model_parallel import recompute
from framework.model_parallel.staged_trainer import state_variables


class ShardedParameters:
  """The model's trainable weights kept as ZeRO-1's shards.

  Args:
    state: the trainer's `optimizer_sharding.ShardedOptimizerState` (its
      `variables` are the model's trainable variables).
    model: the trainer's functional or Sequential Keras model; its `call`
      is made to run in units that gather their weights (inside the step
      only: elsewhere the model runs as built).
    layers_per_unit: top-level layers per unit.
  """

  def __init__(self, state, model, layers_per_unit=1):
    self.state = state
    self.strategy = state.strategy
    self.num_shards = state.num_shards
    self.model = model
    self._inside_step = 0
    # Set while a step is traced if a unit's layers add losses in their
    # call (`add_loss`, activity regularisers): not differentiated here.
    self.layer_losses = False
    self._lock = threading.Lock()
    self._store_fn = None
    _check_model(model)
    if tf.distribute.has_strategy():
      raise ConfigError(
          "shard_parameters=True: make the trainer outside strategy.scope() "
          "(it places the model's whole weights outside the replicas)")
    # The model's whole weights: one copy per process on its host, not one
    # per replica (the replicas' devices hold the shards); the copy is
    # what checkpoints, evaluation and export read.
    with tf.device("CPU:0"):
      for variable in state.variables:
        _tf_internal.initialize_variable(variable, tf.identity(variable.value))
    recompute.recompute_graph(model, layers_per_unit, wrap=self._unit,
                              purpose="shard_parameters=True")

  @property
  def shards(self):
    """The shard variables (replica r's copy holds slice r)."""
    return self.state.shards

  @contextlib.contextmanager
  def gathering(self):
    """Inside: the model's units gather their weights from the shards (the
    step's forward pass). Replica threads trace it at once: a count."""
    with self._lock:
      self._inside_step += 1
    try:
      yield
    finally:
      with self._lock:
        self._inside_step -= 1

  # --- The step. -------------------------------------------------------------

  def _gathered(self, index, local):
    """Variable `index`'s whole value from every replica's shard (`local`:
    this replica's); its gradient is the reduce-scatter of the whole
    gradient (replica context)."""
    state = self.state
    variable = state.variables[index]

    @tf.custom_gradient
    def gather(value):
      context = tf.distribute.get_replica_context()
      whole = optimizer_sharding.unshard(
          context.all_gather(value, axis=0), variable)
      return whole, lambda upstream: state.reduce_scatter_one(upstream, index)

    return gather(local)

  def _unit(self, run, layers):
    """`run` (a unit of `layers`), gathering their weights inside the step."""
    weights, indices = [], []
    for layer in layers:
      for w in layer.trainable_variables:
        index = self.state.index_of(w)
        if index is not None and index not in indices:
          weights.append(w)
          indices.append(index)
    state = state_variables(layers)

    def body(*tensors):
      split = len(tensors) - len(indices)  # the unit's inputs, its shards
      tensors, shards = tensors[:split], tensors[split:]
      # Gathered once the unit's inputs exist: one unit's weights at a time.
      with tf.control_dependencies(
          [t for t in tensors if tf.is_tensor(t)]):
        whole = [self._gathered(i, s) for i, s in zip(indices, shards)]
      with keras.StatelessScope(list(zip(weights, whole)),
                                collect_losses=True) as scope:
        outputs = run(*tensors)
      if scope.losses:  # Keras drops them unless collected: refused
        self.layer_losses = True
      # What the layers wrote (BatchNorm statistics, seed counters), as
      # Keras writes it outside a stateless scope.
      writes = []
      for v in state:
        new = scope.get_current_value(v)
        if new is not None:
          writes.append(v.assign(new))
      with tf.control_dependencies(writes):
        return tf.nest.map_structure(tf.identity, outputs)

    # The shards enter as inputs, read outside the recomputed function: the
    # gradient reaches them there (a function's own reads of non-trainable
    # variables are not differentiated).
    recomputed = recompute.recomputed(body, layers)

    def unit(*tensors):
      if not self._inside_step:
        return run(*tensors)  # evaluation, export: the model's variables
      return recomputed(*tensors, *[self.state.local_shard(i) for i in indices])

    return unit

  # --- The model's variables <-> the shards (outside the step). ------------

  def load(self):
    """Cuts the model's variables into the shards (each local replica's
    slice): at the start of every `train`."""
    state = self.state
    for variable, shard in zip(state.variables, state.shards):
      length = shard.shape[0]
      flat = tf.reshape(optimizer_sharding.padded(
          variable.value, length, self.num_shards), [self.num_shards, length])
      for replica, copy in zip(
          state.replica_ids,
          self.strategy.experimental_local_results(shard.value)):
        copy.assign(flat[replica])

  def store(self):
    """Writes the shards, all-gathered, into the model's variables: at the
    end of every `train`."""
    if self._store_fn is None:
      self._store_fn = tf.function(self._store)
    self._store_fn()

  def _store(self):
    state = self.state
    for index, variable in enumerate(state.variables):
      def gather(index=index):
        context = tf.distribute.get_replica_context()
        return context.all_gather(state.local_shard(index), axis=0)
      gathered = self.strategy.run(gather)
      whole = self.strategy.experimental_local_results(gathered)[0]
      variable.assign(optimizer_sharding.unshard(whole, variable))


def _check_model(model):
  """ConfigError for what reads whole weights inside the step."""
  for layer in _tf_internal.flatten_layers(model):
    for name in ("kernel_regularizer", "bias_regularizer",
                 "embeddings_regularizer", "depthwise_regularizer",
                 "pointwise_regularizer", "gamma_regularizer",
                 "beta_regularizer"):
      if getattr(layer, name, None) is not None:
        raise ConfigError(
            f"shard_parameters=True: layer {layer.name!r} has a {name}, "
            "which reads its whole weight outside the layer's call; use "
            "the optimizer's weight decay (--optimizer=adamw) or turn "
            "shard_parameters off")


class ShardsParameters:
  """What every class `sharded_trainer` makes is (a marker)."""


def sharded_trainer(trainer_cls, layers_per_unit=1):
  """`trainer_cls` with its trainable weights sharded over the replicas
  (ZeRO-3). It takes `trainer_cls`'s arguments and needs
  `shard_optimizer_state=True` and `shard_gradients=True` (ZeRO-1 and 2,
  which it extends) under a (multi-worker) mirrored strategy of 2 or more
  replicas."""
  from framework.core.trainer import Trainer  # pylint: disable=g-import-not-at-top
  if not (isinstance(trainer_cls, type) and issubclass(trainer_cls, Trainer)):
    raise ConfigError(
        f"sharded_trainer: trainer_cls={trainer_cls!r} is not a subclass "
        "of framework.Trainer")
  if issubclass(trainer_cls, ShardsParameters):
    raise ConfigError(
        f"sharded_trainer: {trainer_cls.__name__} shards its weights "
        "already (made by sharded_trainer); wrap the unsharded class once")
  if (isinstance(layers_per_unit, bool)
      or not isinstance(layers_per_unit, int) or layers_per_unit < 1):
    raise ConfigError(
        f"sharded_trainer: layers_per_unit={layers_per_unit!r} is not an "
        "integer >= 1 (the top-level layers a unit runs, --recompute=every:K)")

  class ShardedParametersTrainer(trainer_cls, ShardsParameters):
    """ZeRO-3 over the replicas (`framework.model_parallel.parameter_sharding`)."""

    def __init__(self, model, optimizer, strategy, **kwargs):
      _check_options(strategy, kwargs)
      super().__init__(model, optimizer, strategy, **kwargs)
      self.parameter_sharding = ShardedParameters(
          self.optimizer_sharding, model, layers_per_unit)

    def _make_updater(self, **parts):
      return updates.ShardedParametersUpdate(
          self.strategy, sharding=self.optimizer_sharding, **parts)

    def compute_gradients(self, batch):
      """(d loss_share / d each shard, metric shares): the gradients are
      reduce-scattered inside the backward pass, unit by unit."""
      sharding = self.parameter_sharding
      if self._trained_tracked:
        raise ConfigError(
            "shard_parameters=True shards the model's weights only; a "
            "tracked model trained by the default step is not sharded")
      shards = [s.value for s in sharding.shards]
      with tf.GradientTape() as tape:
        tape.watch(shards)
        with sharding.gathering():
          loss, metrics = self.loss_share(batch)
        scaled_loss = self.scale_loss(loss)
      grads = tape.gradient(scaled_loss, shards)
      self._check_traced(grads)
      grads = [tf.zeros_like(s) if g is None else g
               for g, s in zip(grads, shards)]
      return grads, {"loss": loss, **metrics}

    def _check_traced(self, grads):
      """What the trace shows ZeRO-3 would get wrong (raised by `train`)."""
      if self._trace_error:
        return
      if self.model.losses or self.parameter_sharding.layer_losses:
        # Made inside a recomputed unit, outside what its gradient covers.
        self._trace_error = (
            "shard_parameters=True: the model's layers add losses in their "
            "call (add_loss, activity_regularizer), which its recomputed "
            "units do not differentiate; turn shard_parameters off")
        return
      variables = self.optimizer_sharding.variables
      missing = [v for v, g in zip(variables, grads) if g is None]
      if missing:
        self._trace_error = (
            f"shard_parameters=True: no gradient reaches "
            f"{missing[0].path!r} ({len(missing)} of {len(variables)} "
            "weights): it is gathered only for the top-level layer that "
            "owns it, and this model reads it elsewhere or not at all; "
            "turn shard_parameters off")

    def train(self, iterator, num_steps):
      self._check_whole_weights_unread(iterator, num_steps)
      self.parameter_sharding.load()
      try:
        return super().train(iterator, num_steps)
      finally:
        self.parameter_sharding.store()

    def _check_whole_weights_unread(self, iterator, num_steps):
      """ConfigError if the traced loop reads a whole weight (the host
      copy, stale inside a loop and outside the gradient): a layer that
      reads another top-level layer's weight not through its own."""
      traced = self._train_loop.get_concrete_function(
          iterator, tf.constant(num_steps, tf.int32))
      if self._trace_error:
        return  # `train` raises it
      handles = {id(_tf_internal.variable_handle(v)): v
                 for v in self.optimizer_sharding.variables}
      for external, _ in traced.graph.captures:
        variable = handles.get(id(external))
        if variable is not None:
          raise ConfigError(
              f"shard_parameters=True: the step reads {variable.path!r} "
              "whole, outside the top-level layer that owns it (weights "
              "are gathered per top-level layer); turn shard_parameters "
              "off")

  ShardedParametersTrainer.__name__ = f"ShardedParameters{trainer_cls.__name__}"
  ShardedParametersTrainer.__qualname__ = ShardedParametersTrainer.__name__
  return ShardedParametersTrainer


def _check_options(strategy, kwargs):
  """ConfigError for settings ZeRO-3 cannot go with (one line each)."""
  if not isinstance(strategy, optimizer_sharding.STRATEGIES):
    raise ConfigError(
        f"shard_parameters=True needs a strategy whose replicas each hold "
        f"the variables (mirrored, multi_worker_mirrored), not "
        f"{type(strategy).__name__}")
  if strategy.num_replicas_in_sync < 2:
    raise ConfigError(
        "shard_parameters=True shards the weights over the replicas; this "
        "strategy has 1 (use --cpu_devices=2 or more, or more workers)")
  for name, needed in (("shard_optimizer_state", True),
                       ("shard_gradients", True)):
    if kwargs.get(name) is not needed:
      raise ConfigError(
          f"shard_parameters=True needs {name}=True (ZeRO-3 shards the "
          f"weights of ZeRO-1 and 2's sharded update); add --{name}")
  for name, off, what in (
      ("ema_decay", None, "an EMA of the whole weights"),
      ("log_layer_norms", False, "per-layer norms of the whole weights"),
      ("jit_compile", False, "XLA around the gathering collectives")):
    if kwargs.get(name, off) not in (off,):
      raise ConfigError(
          f"shard_parameters=True does not support {name}="
          f"{kwargs[name]} ({what} inside the step); turn {name} off")
