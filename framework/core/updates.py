"""The optimizer update of a step: one object per kind of update.

An update kind applies a step's reduced (and clipped) gradients to the
variables exactly once, and holds what decides or follows that update:

- the skip: under `nan_policy=skip` or a float16 loss scale a step whose
  reduced gradient is not finite changes nothing (counted in
  `skipped_steps` and `consecutive_skips`); under `spike_policy` skip or
  rollback a loss spike is dropped alike (`framework.core.spikes`);
- the float16 loss scale (`framework.core.precision.LossScale`): the loss
  scaled before differentiation, the gradients unscaled after the
  all-reduce, the scale updated from each step's finiteness;
- the EMA of the weights (`framework.core.optimizers.WeightAverage`),
  advanced after each applied update.

The kinds, and where each is used:

    MergeCallUpdate        one merge_call per step; each variable's copies
                           updated with the gradient already on their device
                           (default, one_device, mirrored, multi-worker,
                           central storage, tpu, the model splits)
    ParameterServerUpdate  the same update without merge_call, which a
                           parameter-server worker (one replica) lacks
    ShardedUpdate          ZeRO-1 over replicas (`optimizer_sharding.
                           ShardedOptimizerState`): the gradients reduce-
                           scattered, each replica updates its 1/N shard of
                           every variable, then one all-gather of the
                           weights is assigned as the update
    ShardedGradientsUpdate ZeRO-2 over replicas: `ShardedUpdate` whose
                           gradients are always reduce-scattered, under
                           gradient accumulation each micro-batch's, so
                           that a replica holds and accumulates only its
                           1/N slice of the gradient
    CopyShardedUpdate      ZeRO-1 over a split's copies on a mesh's data axis
                           (`optimizer_sharding.CopyShardedState`)
    CopyShardedGradientsUpdate
                           ZeRO-2 over a split's copies: `CopyShardedUpdate`
                           on gradients reduce-scattered over the copies
                           (each accumulation step's), copy r holding only
                           its 1/R slice
    CopyShardedParametersUpdate
                           ZeRO-3 over a split's copies: the shards are the
                           weights, updated in place with the scattered
                           slices, nothing joined after

Every kind has one entry point, `apply(grads, variables, signals=(),
scattered_norm=None) -> applied` (a bool tensor: whether the update ran),
called in replica context by `Trainer.apply_gradients`, and says how the
gradients reach it: `scatters()`, whether the step reduce-scatters them
(`reduce_scatter`: each replica receives only its slice of the sum, which
`apply` then takes with `scattered_norm`, the whole gradient's norm) or
all-reduces them whole; `signals` are the step's spike signals
(`Trainer.spike_signals`). The per-variable optimizer math stays the
trainer's (`update_variable`, which a trainer may override to place it),
and the optimizer is read from the trainer at each trace (the distribution
check swaps in a probe). The trainer chooses its kind once, at construction
(`choose`; a split trainer with sharded copies chooses `CopyShardedUpdate`,
or with sharded gradients `CopyShardedGradientsUpdate`):
a new way of updating (sharded gradients, sharded parameters) is one more
kind here.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import tensorflow as tf

from framework import _tf_internal
from framework.core.config import TrainerConfig
from framework.core.optimizers import fused_update
from framework.settings import default


def update_variable(optimizer, grad, var, learning_rate, *, fused=True):
  """One variable's optimizer step with its reduced gradient (Keras's
  order: decoupled weight decay (AdamW), then the step, as one fused kernel
  where TensorFlow has one and `fused`)."""
  weight_decay = getattr(optimizer, "weight_decay", None)
  if weight_decay and _tf_internal.uses_weight_decay(optimizer, var):
    var.assign_sub(var * tf.cast(weight_decay, var.dtype) * learning_rate)
  # One kernel per variable instead of Keras's chain of element-wise ops.
  update_step = (fused and fused_update(optimizer)) or optimizer.update_step
  return update_step(grad, var, learning_rate)


class MergeCallUpdate:
  """One update per step in a merge_call, with its skip, loss scale and EMA.

  Args:
    strategy: the run's `tf.distribute.Strategy`.
    optimizer: `() -> the optimizer` (read at each trace).
    update_variable: `(grad, var, learning_rate) -> op`, one variable copy's
      optimizer step.
    global_step: the trainer's step counter (a rollback records the step).
    skipped_steps, consecutive_skips: the skip counters.
    nan_policy: `stop` or `skip`.
    loss_scale: a `LossScale` (float16), or None.
    ema: a `WeightAverage`, or None.
    spikes: a `SpikeWindow`, or None (no spike check).
    on_assign: called (while tracing) when `assign` makes a step's update,
      so that the trainer knows its step has one; None: nothing.
  """

  def __init__(self, strategy: tf.distribute.Strategy, *,
               optimizer: Callable[[], Any],
               update_variable: Callable[..., Any], global_step: tf.Variable,
               skipped_steps: tf.Variable, consecutive_skips: tf.Variable,
               nan_policy: str = default(TrainerConfig, "nan_policy"),
               loss_scale: Any = None,
               ema: Any = None, spikes: Any = None,
               on_assign: Callable[[], None] | None = None):
    self.strategy = strategy
    self._optimizer = optimizer
    self.update_variable = update_variable
    self.global_step = global_step
    self.skipped_steps = skipped_steps
    self.consecutive_skips = consecutive_skips
    self.nan_policy = nan_policy
    self.loss_scale = loss_scale
    self.ema = ema
    self.spikes = spikes
    self.on_assign = on_assign

  @property
  def optimizer(self):
    return self._optimizer()

  def state_variables(self) -> list[Any]:
    """What an update changes besides the weights and the optimizer: the
    EMA's, the loss scale's, the spike window's and the skip counters."""
    state = []
    if self.ema is not None:
      state += list(self.ema.averages) + [self.ema.num_updates]
    if self.loss_scale is not None:
      state += [self.loss_scale.scale, self.loss_scale.good_steps]
    if self.spikes is not None:
      state += list(self.spikes.variables)
    return state + [self.skipped_steps, self.consecutive_skips]

  # --- The loss scale. -------------------------------------------------------

  def scale_loss(self, loss: tf.Tensor) -> tf.Tensor:
    """`loss` times the float16 loss scale (unchanged without one)."""
    return loss if self.loss_scale is None else self.loss_scale.scale_loss(loss)

  def unscale(self, grads: Sequence[tf.Tensor]) -> list[tf.Tensor]:
    """Reduced gradients divided by the loss scale (unchanged without one)."""
    return grads if self.loss_scale is None else self.loss_scale.unscale(grads)

  # --- The reduction. --------------------------------------------------------

  # Whether the step reduces each micro-batch's gradients as it comes (where
  # `scatters()`), accumulating only the reduced slices (ZeRO-2), instead
  # of reducing the accumulated sum once.
  scatters_micro_batches = False

  def scatters(self) -> bool:
    """Whether the step reduce-scatters the gradients for this kind (in
    replica context, as traced now): each replica then receives only its
    slice of the sum (`reduce_scatter`)."""
    return False

  def reduce_scatter(self, grads: Sequence[tf.Tensor]) -> list[tf.Tensor]:
    """This replica's slice of the SUM over replicas of each of `grads`
    (only for a kind that `scatters()`)."""
    raise NotImplementedError(f"{type(self).__name__} does not scatter")

  # --- The update. -----------------------------------------------------------

  def apply(self, grads: Sequence[tf.Tensor], variables: Sequence[Any],
            signals: Any = (), scattered_norm: tf.Tensor | None = None) -> Any:
    """Applies the reduced `grads` to `variables` once (replica context);
    returns whether it did (a bool tensor). `scattered_norm`: `grads` are
    this replica's slices (`reduce_scatter`) and this the whole gradient's
    norm (finiteness is judged on it, the same on every replica)."""
    if scattered_norm is not None:
      raise ValueError(f"{type(self).__name__} takes whole gradients, "
                       "not reduce-scattered slices")
    finite = tf.math.is_finite(global_norm(grads))
    return self._apply(grads, variables, finite, signals)

  def _apply(self, grads, variables, finite, signals):
    context = tf.distribute.get_replica_context()
    return context.merge_call(self._update, args=(grads, variables, finite),
                              kwargs={"signals": signals})

  def assign(self, weights, variables, finite, signals=()):
    """Sets `variables` to `weights`, updated elsewhere (gathered from the
    optimizer's shards), as one step: the step count, the EMA and the skip
    counters as in `apply`, with `assign` as the update."""
    if self.on_assign is not None:
      self.on_assign()
    return tf.distribute.get_replica_context().merge_call(
        self._update, args=(weights, variables, finite),
        kwargs={"assign": True, "signals": signals})

  def if_finite(self, finite, update, spike=None):
    """`update()` (it returns a bool tensor), under `nan_policy=skip` or a
    float16 loss scale only where `finite` (else False), and never on a
    `spike`."""
    if spike is not None:
      finite = tf.logical_and(finite, tf.logical_not(spike))
    elif self.nan_policy != "skip" and self.loss_scale is None:
      return update()
    return tf.cond(finite, update, lambda: tf.constant(False))

  def _spike(self, strategy, signals):
    """(spike bool, loss, norm) in cross-replica context from the replicas'
    equal `signals`; None without them."""
    if not signals:
      return None
    loss, norm = (strategy.experimental_local_results(v)[0] for v in signals)
    return self.spikes.is_spike(loss, norm), loss, norm

  def _update(self, strategy, grads, variables, finite, assign=False,
              signals=()):
    """Cross-replica: one optimizer update with the reduced gradients
    (`assign`: `grads` are the new weights, gathered from the shards)."""
    optimizer = self.optimizer

    def update_all():
      lr = optimizer.learning_rate

      def update_one(var, grad):
        if assign:
          return var.assign(grad)
        return self.update_variable(grad, var, tf.cast(lr, var.dtype))

      for grad, var in zip(grads, variables):
        var = getattr(var, "value", var)  # the tf.Variable behind a Keras one
        copies = strategy.experimental_local_results(var)
        if len(copies) == 1 and strategy.num_replicas_in_sync > 1:
          # One central copy (central storage): replicas hold equal values.
          grad = strategy.experimental_local_results(grad)[0]
        strategy.extended.update(var, update_one, args=(grad,), group=False)
      # On the tf.Variable: Keras's assign_add is a read then an assign,
      # which loses increments when PS workers update concurrently.
      iterations = optimizer.iterations
      getattr(iterations, "value", iterations).assign_add(1)
      if self.ema is not None:
        # Reads the updated weights (TF orders ops on the same variables).
        self.ema.update()
      return tf.constant(True)

    spike = self._spike(strategy, signals)
    if (self.nan_policy != "skip" and self.loss_scale is None
        and spike is None):
      return update_all()

    def apply():
      update_all()
      self.consecutive_skips.assign(0)
      return tf.constant(True)

    def skip():
      self.skipped_steps.assign_add(1)
      self.consecutive_skips.assign_add(1)
      return tf.constant(False)

    # A float16 overflow is expected now and then: skip it, shrink the scale.
    finite = strategy.experimental_local_results(finite)[0]
    if spike is None:
      applied = tf.cond(finite, apply, skip)
    else:
      applied = self._apply_unless_spike(finite, spike, apply, skip)
    if self.loss_scale is not None:
      with tf.control_dependencies([self.loss_scale.update(finite)]):
        applied = tf.identity(applied)
    return applied

  def _apply_unless_spike(self, finite, spike, apply, skip):
    """`apply()` unless `spike` (then counted, and under rollback the step
    recorded for the Controller) or not finite (`skip()` under
    nan_policy=skip or a loss scale; else applied, as without spikes);
    a finite step's loss and norm then enter the window."""
    spike, loss, norm = spike
    window = self.spikes

    def drop():
      counted = [window.skipped.assign_add(1)]
      if window.policy == "rollback":
        counted.append(window.pending.assign(self.global_step + 1))
      with tf.control_dependencies(counted):
        return tf.constant(False)

    if self.nan_policy == "skip" or self.loss_scale is not None:
      not_finite = skip
    else:
      not_finite = apply
    applied = tf.cond(
        finite, lambda: tf.cond(spike, drop, apply), not_finite)
    with tf.control_dependencies([applied]):
      pushed = tf.cond(finite, lambda: window.push(loss, norm),
                       lambda: tf.constant(False))
    with tf.control_dependencies([pushed]):
      return tf.identity(applied)


class ParameterServerUpdate(MergeCallUpdate):
  """The update on a parameter-server worker: one replica, no merge_call
  (the update ops run where the variables live, on the ps tasks)."""

  def _apply(self, grads, variables, finite, signals):
    return self._update(self.strategy, grads, variables, finite,
                        signals=signals)


class ShardedUpdate(MergeCallUpdate):
  """ZeRO-1 over replicas: each replica updates its shard of every variable
  with its slice of the reduced gradient, then the shards are all-gathered
  into the weights, assigned as the step's update.

  With `scatter` the default step reduce-scatters the gradients
  (`scatters()`: all-to-all + local sum, `framework.distribute.
  collectives`), so each replica receives only the slice it updates;
  `apply` also takes whole reduced gradients (a `train_step` override's
  `all_reduce`) and slices them.

  Args:
    sharding: the trainer's `optimizer_sharding.ShardedOptimizerState`.
    scatter: reduce-scatter the gradients (the all-reduce options are the
      defaults); False: all-reduce them whole, then slice.
    **kwargs: `MergeCallUpdate`'s.
  """

  def __init__(self, strategy, *, sharding, scatter=True, **kwargs):
    super().__init__(strategy, **kwargs)
    self.sharding = sharding
    self.scatter = scatter

  def scatters(self):
    # Not while the distribution check's probe optimizer (unsharded) is in.
    return (self.scatter and self.sharding.optimizer is self.optimizer
            and tf.distribute.get_replica_context() is not None)

  def reduce_scatter(self, grads):
    return self.sharding.reduce_scatter(grads)

  def apply(self, grads, variables, signals=(), scattered_norm=None):
    if scattered_norm is None:
      return super().apply(grads, variables, signals)
    finite = tf.math.is_finite(scattered_norm)
    return self._apply(grads, variables, finite, signals, scattered=True)

  def _apply(self, grads, variables, finite, signals, scattered=False):
    sharding = self.sharding
    if sharding.optimizer is not self.optimizer:
      # The distribution check's probe optimizer, built unsharded.
      return super()._apply(grads, variables, finite, signals)
    if [id(v) for v in variables] != [id(v) for v in sharding.variables]:
      raise ValueError("shard_optimizer_state: apply_gradients updates the "
                       "model's trainable variables only")
    context = tf.distribute.get_replica_context()
    replica = context.replica_id_in_sync_group
    grad_shards = (list(grads) if scattered
                   else sharding.local_shards(grads, replica))
    weight_shards = sharding.local_shards(variables, replica)
    context.merge_call(self._update_shards, args=(
        sharding, grad_shards, weight_shards, finite),
                       kwargs={"signals": signals})
    weights = sharding.gather_weights(context)
    return self.assign(weights, variables, finite, signals)

  def _update_shards(self, strategy, sharding, grad_shards, weight_shards,
                     finite, signals=()):
    """Cross-replica: each copy of each shard variable is set to its
    replica's slice of the weights (none: the shards are the weights, as
    under ZeRO-3) and updated with its gradient slice."""
    optimizer = self.optimizer

    def update_all():
      lr = optimizer.learning_rate

      def update_one(shard, grad, weight=None):
        assigned = [] if weight is None else [shard.assign(weight)]
        with tf.control_dependencies(assigned):
          return self.update_variable(grad, shard, tf.cast(lr, shard.dtype))

      for i, (grad, shard) in enumerate(zip(grad_shards, sharding.shards)):
        args = (grad,) if weight_shards is None else (grad, weight_shards[i])
        strategy.extended.update(shard.value, update_one, args=args,
                                 group=False)
      return tf.constant(True)

    spike = self._spike(strategy, signals)
    return self.if_finite(strategy.experimental_local_results(finite)[0],
                          update_all, spike and spike[0])


class ShardedGradientsUpdate(ShardedUpdate):
  """ZeRO-2 over replicas: ZeRO-1's update (`ShardedUpdate`) on gradients
  that each replica holds only 1/N of. The gradients are always
  reduce-scattered, and under gradient accumulation each micro-batch's as
  soon as it is computed, so the accumulator holds [L]-element slices
  (1/N of the gradient) instead of the whole gradient: K reduce-scatters
  per step instead of one, each half an all-reduce's bytes.

  Args:
    sharding: the trainer's `optimizer_sharding.ShardedOptimizerState`.
    **kwargs: `MergeCallUpdate`'s.
  """

  scatters_micro_batches = True

  def __init__(self, strategy, *, sharding, **kwargs):
    super().__init__(strategy, sharding=sharding, scatter=True, **kwargs)


class ShardedParametersUpdate(ShardedGradientsUpdate):
  """ZeRO-3 over replicas: the shards are the weights
  (`framework.model_parallel.parameter_sharding`). The gradients arrive
  reduce-scattered from the backward pass (the gather's gradient), so
  `reduce_scatter` passes them on; each replica updates its shards in
  place, and nothing is gathered after the update (the next forward pass
  gathers each unit's weights).

  Args:
    sharding: the trainer's `optimizer_sharding.ShardedOptimizerState`.
    **kwargs: `MergeCallUpdate`'s.
  """

  def reduce_scatter(self, grads):
    return list(grads)  # this replica's slices already

  def state_variables(self):
    return super().state_variables() + list(self.sharding.shards)

  def _apply(self, grads, variables, finite, signals, scattered=False):
    sharding = self.sharding
    if not scattered or sharding.optimizer is not self.optimizer:
      raise ValueError("shard_parameters: apply_gradients takes the "
                       "reduce-scattered gradients of the default step")
    context = tf.distribute.get_replica_context()
    context.merge_call(self._update_shards, args=(
        sharding, list(grads), None, finite), kwargs={"signals": signals})
    # The step count, the skip counters and the loss scale, as every kind.
    return self.assign([], [], finite, signals)


class CopyShardedUpdate(MergeCallUpdate):
  """ZeRO-1 over the R copies of a split (one replica): copy r updates
  slice r of each of its variables, then every copy's variables are joined
  from all copies' slices and assigned as the step's update.

  `apply`'s `grads` and `variables` are the R copies' lists concatenated,
  copy 0's first; finiteness is judged on copy 0's (all copies hold the
  same summed gradient). Spike signals are not taken.

  Args:
    sharding: the split's `optimizer_sharding.CopyShardedState`.
    **kwargs: `MergeCallUpdate`'s.
  """

  def __init__(self, strategy, *, sharding, **kwargs):
    super().__init__(strategy, **kwargs)
    self.sharding = sharding

  def apply(self, grads, variables, signals=(), scattered_norm=None):
    del signals  # copies are sharded without a spike check
    if scattered_norm is not None and not self.scatters():
      raise ValueError(f"{type(self).__name__} takes whole gradients")
    count = len(self.sharding.variables[0])
    per_copy = lambda values: [values[i:i + count]
                               for i in range(0, len(values), count)]
    finite = tf.math.is_finite(global_norm(grads[:count])
                               if scattered_norm is None else scattered_norm)
    learning_rate = self.optimizer.learning_rate

    def update():
      self.sharding.update_shards(
          self.update_variable, per_copy(grads), per_copy(variables),
          learning_rate, scattered=scattered_norm is not None)
      return tf.constant(True)

    self.if_finite(finite, update)
    weights = self.sharding.gather(per_copy(variables))
    return self.assign(weights, variables, finite)


class CopyShardedGradientsUpdate(CopyShardedUpdate):
  """ZeRO-2 over the R copies of a split: `CopyShardedUpdate` on gradients
  that copy r holds only its slice of. Each stage's (a tensor split: each
  device position's) gradients are reduce-scattered over the copies
  (`copies.reduce_scatter_copies`), under gradient accumulation each
  accumulation step's, so copy r accumulates and updates with 1/R of the
  gradient.

  `apply` takes the R copies' slices, copy 0's first, with
  `scattered_norm`, the whole summed gradient's norm (finiteness is judged
  on it); whole gradients (`scattered_norm=None`) as `CopyShardedUpdate`.

  Args:
    sharding: the split's `optimizer_sharding.CopyShardedState`.
    **kwargs: `MergeCallUpdate`'s.
  """

  scatters_micro_batches = True

  def scatters(self):
    # Not while the distribution check's probe optimizer (unsharded) is in.
    return self.sharding.optimizers[0] is self.optimizer


class CopyShardedParametersUpdate(CopyShardedGradientsUpdate):
  """ZeRO-3 over the R copies of a pipeline
  (`framework.model_parallel.copy_parameter_sharding`): the shards are the
  weights. Copy r's shards are updated in place with its reduce-scattered
  slices; nothing is joined after the update (each layer joins its
  weights in the next forward pass), and the copies' model variables are
  left as they are.

  Args:
    sharding: the split's `optimizer_sharding.CopyShardedState`.
    **kwargs: `MergeCallUpdate`'s.
  """

  def state_variables(self):
    return super().state_variables() + [
        s for shards in self.sharding.shards for s in shards]

  def apply(self, grads, variables, signals=(), scattered_norm=None):
    del signals  # copies are sharded without a spike check
    if scattered_norm is None or not self.scatters():
      raise ValueError("shard_parameters: the copies' update takes the "
                       "reduce-scattered gradients of the pipeline's step")
    count = len(self.sharding.variables[0])
    per_copy = lambda values: [values[i:i + count]
                               for i in range(0, len(values), count)]
    finite = tf.math.is_finite(scattered_norm)
    learning_rate = self.optimizer.learning_rate

    def update():
      self.sharding.update_shards(
          self.update_variable, per_copy(grads), per_copy(variables),
          learning_rate, scattered=True, in_place=True)
      return tf.constant(True)

    self.if_finite(finite, update)
    # The step count, the skip counters and the loss scale, as every kind.
    return self.assign([], [], finite)


def global_norm(tensors: Sequence[Any]) -> tf.Tensor:
  """`tf.linalg.global_norm` of `tensors`, also where their dtypes differ
  (a float16 or float64 layer beside float32 ones: measured in float32;
  TensorFlow's stacks the per-tensor norms, which needs one dtype)."""
  if len({t.dtype for t in tensors if t is not None}) > 1:
    tensors = [None if t is None else tf.cast(t, tf.float32)
               for t in tensors]
  return tf.linalg.global_norm(tensors)


def choose(strategy: tf.distribute.Strategy, *, sharding: Any = None,
           scatter: bool = True,
           shard_gradients: bool = default(TrainerConfig, "shard_gradients"),
           **kwargs: Any) -> MergeCallUpdate:
  """The update kind for `strategy`: `ParameterServerUpdate` under a
  parameter-server strategy, with `sharding` (a `ShardedOptimizerState`)
  `ShardedGradientsUpdate` if `shard_gradients` else `ShardedUpdate`
  (`scatter`: it reduce-scatters the gradients), else `MergeCallUpdate`;
  `kwargs`: `MergeCallUpdate`'s."""
  if isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy):
    return ParameterServerUpdate(strategy, **kwargs)
  if sharding is not None and shard_gradients:
    return ShardedGradientsUpdate(strategy, sharding=sharding, **kwargs)
  if sharding is not None:
    return ShardedUpdate(strategy, sharding=sharding, scatter=scatter,
                         **kwargs)
  return MergeCallUpdate(strategy, **kwargs)
