"""The Trainer: the math of one distributed training step, and nothing else.

The outer loop (checkpoints, summaries, evaluation schedule, logging) lives in
`framework.core.controller`. A Trainer subclass changes the math by overriding
`compute_loss` (the loss of one batch); `train_step` then does everything else
for it, under every strategy. One training step, per replica, inside
`strategy.run` inside a `tf.function`:

    for each of grad_accum_steps micro-batches b of this replica's batch:
      per_ex, metrics = compute_loss(b)             # the override point
      loss    = sum(per_ex) / global_batch_size     # this replica's share of
                + regularisers / (replicas * K)     # the global-batch mean
      grads  += d (loss * loss_scale) / d weights   # local gradients
    grads     = all_reduce_sum(grads) / loss_scale  # = grad of the global mean
    grads     = clip_by_global_norm(grads)          # on the reduced gradient
    apply(grads)     # exactly one update; skipped if not finite (nan_policy=
                     # skip, float16 overflow); then the EMA of the weights
    return {"loss": loss, **metrics}                # shares; the trainer sums
                                                    # them over replicas

A step that needs the whole thing (two optimizers, a GAN) overrides
`train_step` and uses the helpers (`all_reduce`, `clip_by_global_norm`,
`apply_gradients`, which also does the NaN skip and the EMA); the features
only the default `train_step` has (gradient accumulation, float16 loss
scaling) are then a `ConfigError` at construction unless the subclass lists
them in `train_step_handles`.

The parts live beside this file, one concept each, as mixins of `Trainer`:
`gradients.py` (accumulate, reduce, clip, apply, skip), `eval_step.py` (the
masked evaluation sums), `step_loop.py` (`steps_per_loop` steps in one
`tf.function` call, ending early at a stop request or too many skips) and
`replica_sync.py` (BatchNorm statistics averaged over replicas).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Mapping

import keras
import tensorflow as tf
from absl import logging

from framework.core import optimizer_sharding, tta, xla
from framework.core.config import TrainerConfig
from framework.core.ema import WeightAverage
from framework.core.eval_step import (Evaluating, masked_sum,  # pylint: disable=unused-import
                                      real_rows)
from framework.core.gradients import GradientPipeline
from framework.core.replica_sync import replica_sync_fn
from framework.core.step_loop import StepLoop
from framework.errors import ConfigError, check_positive
from framework.settings import default

SUM = tf.distribute.ReduceOp.SUM
# The step settings' keyword defaults: `TrainerConfig`'s, declared once.
_default = functools.partial(default, TrainerConfig)
# What only the default `train_step` does, by the argument that turns it on.
STEP_FEATURES = {"grad_accum_steps": "gradient accumulation",
                 "loss_scale": "float16 loss scaling"}


def sparse_categorical_loss(labels: tf.Tensor,
                            logits: tf.Tensor) -> tf.Tensor:
  """Per-example (or per-pixel) cross-entropy from logits, in float32."""
  return keras.losses.sparse_categorical_crossentropy(
      labels, tf.cast(logits, tf.float32), from_logits=True)


class Trainer(StepLoop, GradientPipeline, Evaluating):
  """Trains `model` with `optimizer` under `strategy`, explicitly.

  To change the loss, override `compute_loss(batch) -> (loss, metrics)`:

      def compute_loss(self, batch):
        images, labels = batch
        logits = self.model(images, training=True)
        return self.loss_fn(labels, logits), {
            "accuracy": self.correct(labels, logits)}

  `loss` is per-example ([batch] or [batch, ...], each example's mean is
  taken), averaged by the trainer over the GLOBAL batch; or a scalar that is
  already this replica's share (`self.average(...)`). Metrics are per-example
  values (averaged alike) or scalar shares. The trainer adds the layer
  regularisers (`model.losses`) and reports the total as `loss`. A
  subclass's options are constructor keywords, not class attributes.

  Overriding `train_step` instead takes over the whole step; see the module
  docstring for what it must then do and what it may not be combined with.

  Args:
    model: a built Keras model, created inside `strategy.scope()`.
    optimizer: a Keras optimizer, created inside `strategy.scope()`.
    strategy: the `tf.distribute.Strategy` the model was built under.
    global_batch_size: examples per step summed over all replicas; losses are
      averaged over this number, never over the per-replica batch.
    loss_fn: `(labels, outputs) -> per-example losses` (any trailing shape:
      every element is averaged). Default: sparse cross-entropy from logits.
    clip_norm: clip the all-reduced gradient to this global norm (None: off).
    nan_policy: `stop` (the controller stops at a non-finite loss) or `skip`
      (a step whose reduced loss or gradient is not finite changes nothing).
    max_skipped_steps: under `nan_policy=skip`, the training loop stops after
      this many skipped steps in a row (the controller then raises
      `NonFiniteLossError`): a diverged model skips forever.
    grad_accum_steps: split each replica's batch into this many micro-batches
      and sum their gradients before the one all-reduce and update: the same
      update as the whole batch at 1/grad_accum_steps of the activations.
    loss_scale: a `framework.core.precision.LossScale` (float16 training), or None.
    fused_updates: update with TensorFlow's one-kernel optimizer ops where
      there is one (`framework.core.fused_updates`), else `update_step`.
    ema_decay: keep an exponential moving average of the trainable weights
      (`framework.core.ema`) after each applied update, which evaluation
      uses. None: off.
    ema_warmup: the EMA's decay ramps up as min(decay, (1+n)/(10+n)).
    eval_tta: test-time augmentation in evaluation (`framework.core.tta`):
      `none` or `flip` (mean logits of each image and its mirror).
    all_reduce: a `framework.core.communication.AllReduceConfig` (packing,
      implementation, wire dtype of the gradient all-reduce); None: defaults.
    jit_compile: compile the replica step with XLA where TensorFlow can
      (`framework.core.xla`: the whole step on one replica, each replica's
      forward and backward pass under several; a warning where it cannot).
    shard_optimizer_state: each replica keeps and updates 1/N of the
      optimizer's slots (`framework.core.optimizer_sharding`, ZeRO-1) under
      (multi-worker) mirrored strategies; one replica: no change.
  """

  def __init__(self, model: keras.Model,
               optimizer: keras.optimizers.Optimizer,
               strategy: tf.distribute.Strategy, *, global_batch_size: int,
               loss_fn: Callable[[tf.Tensor, tf.Tensor], tf.Tensor] = (
                   sparse_categorical_loss),
               clip_norm: float | None = _default("clip_norm"),
               nan_policy: str = _default("nan_policy"),
               grad_accum_steps: int = _default("grad_accum_steps"),
               loss_scale: Any = None, fused_updates: bool = True,
               max_skipped_steps: int = _default("max_skipped_steps"),
               ema_decay: float | None = _default("ema_decay"),
               ema_warmup: bool = _default("ema_warmup"),
               eval_tta: str = _default("eval_tta"),
               all_reduce: Any = _default("all_reduce"),
               jit_compile: bool = _default("jit_compile"),
               shard_optimizer_state: bool = _default(
                   "shard_optimizer_state")) -> None:
    check_positive("global_batch_size", global_batch_size)
    TrainerConfig(  # checks the step settings, one ConfigError naming one
        clip_norm=clip_norm, nan_policy=nan_policy,
        max_skipped_steps=max_skipped_steps, grad_accum_steps=grad_accum_steps,
        ema_decay=ema_decay, eval_tta=eval_tta)
    replicas = strategy.num_replicas_in_sync
    if global_batch_size % replicas:
      raise ConfigError(
          f"global_batch_size={global_batch_size} is not divisible by the "
          f"{replicas} replicas of this strategy; use a multiple of {replicas}")
    if (global_batch_size // replicas) % grad_accum_steps:
      raise ConfigError(
          f"grad_accum_steps={grad_accum_steps} does not divide the per-replica "
          f"batch {global_batch_size // replicas} (global_batch_size="
          f"{global_batch_size} / {replicas} replicas)")
    self.model = model
    self.optimizer = optimizer
    self.strategy = strategy
    self.global_batch_size = global_batch_size
    self.loss_fn = loss_fn
    self.clip_norm = clip_norm
    self.nan_policy = nan_policy
    self.grad_accum_steps = grad_accum_steps
    self.loss_scale = loss_scale
    self.fused_updates = fused_updates
    self.max_skipped_steps = max_skipped_steps
    self.eval_tta = tta.check_tta(eval_tta)
    self.communication = all_reduce  # an AllReduceConfig, or None
    self.ema = None if ema_decay is None else WeightAverage(
        model.trainable_variables, strategy, ema_decay, warmup=ema_warmup)
    # Set when the optimizer state is sharded over the replicas.
    self.optimizer_sharding = None
    if shard_optimizer_state and replicas == 1:
      logging.info("shard_optimizer_state: one replica, nothing to shard")
    with strategy.scope():
      # Slots exist before tracing, so checkpoints restore into them eagerly.
      if shard_optimizer_state and replicas > 1:
        self.optimizer_sharding = optimizer_sharding.ShardedOptimizerState(
            optimizer, strategy, model.trainable_variables)
      else:
        optimizer.build(model.trainable_variables)
      self.global_step = tf.Variable(
          0, dtype=tf.int64, trainable=False, name="global_step",
          aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
      # Steps whose update was skipped (non-finite loss or gradient, float16
      # overflow): in total since this trainer was built, and in a row.
      # Not checkpointed, so that checkpoints stay as they were.
      self.skipped_steps, self.consecutive_skips = (
          tf.Variable(0, dtype=tf.int64, trainable=False, name=name,
                      aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
          for name in ("skipped_steps", "consecutive_skips"))
    # Read by the training loop before every step and set from another
    # thread (a signal watcher) while the loop runs: one host variable,
    # outside the strategy, so that no replica copies can disagree.
    with tf.device("CPU:0"):
      self.stop_requested = tf.Variable(False, trainable=False,
                                        name="stop_requested")
    self._check_step_features()
    # Set by `apply_gradients` while a step is traced (see `_one_step`).
    self._applied_in_trace = False
    self._trace_error = None
    # What XLA compiles (framework/core/xla.py): the replica step (then
    # `distributed_train_step` runs `_replica_step`) or its gradients.
    self.jit_compile = xla.jit_mode(jit_compile, strategy)
    self._replica_step = None  # None: `train_step` as it is at each trace
    if self.jit_compile == xla.STEP:
      self._replica_step = xla.compiled_step(self)
    elif self.jit_compile == xla.GRADIENTS:
      self.compute_gradients = xla.compiled(self.compute_gradients)
    self._train_loop = tf.function(self._train_loop_fn)
    self._sync_fn = None
    self._eval_loop = tf.function(self._eval_loop_fn)

  # Features of STEP_FEATURES that a `train_step` override implements itself.
  train_step_handles = ()
  # Extra objects the checkpoint holds by name (see `track`).
  tracked_objects = {}

  def track(self, **objects: Any) -> None:
    """Checkpoints `objects` (extra models, optimizers, variables: a
    teacher, a discriminator and its optimizer) with the run, by name.

    `__init__` does not run under `strategy.scope()`: create them in
    `with self.strategy.scope():` (an optimizer built there, `opt.build(
    variables)`, so that a resume restores its slots), then track them.
    Raises ConfigError, in one line, for an object whose variables were
    created outside the scope or an optimizer not yet built.
    """
    for name, value in objects.items():
      where = f"{type(self).__name__}.track({name}=...)"
      if (isinstance(value, keras.optimizers.Optimizer)
          and not value.built):
        raise ConfigError(f"{where}: the optimizer is not built; call "
                          f"{name}.build(variables) under "
                          "self.strategy.scope() before tracking it")
      variables = getattr(value, "variables", None)
      if variables is None and isinstance(value, tf.Variable):
        variables = [value]
      for v in variables or ():
        if not self.strategy.extended.variable_created_in_scope(
            getattr(v, "value", v)):
          raise ConfigError(
              f"{where}: its variable {v.name!r} was created outside "
              f"strategy.scope(); create it under `with "
              f"self.strategy.scope():` in __init__ (under "
              f"{type(self.strategy).__name__} each replica needs its copy)")
    self.tracked_objects = dict(self.tracked_objects, **objects)

  @property
  def num_replicas(self) -> int:
    return self.strategy.num_replicas_in_sync

  @property
  def checkpointed_optimizer(self) -> Any:
    """What checkpoints hold as `optimizer`: the optimizer, or with sharded
    state a view of it that saves each slot whole (the same keys)."""
    if self.optimizer_sharding is None:
      return self.optimizer
    return self.optimizer_sharding.checkpointed_optimizer

  def _check_step_features(self):
    """A `train_step` override would drop accumulation or loss scaling."""
    cls = type(self)
    if cls.train_step is Trainer.train_step:
      return
    on = {"grad_accum_steps": self.grad_accum_steps > 1,
          "loss_scale": self.loss_scale is not None}
    for name, feature in STEP_FEATURES.items():
      if on[name] and name not in self.train_step_handles:
        value = (self.grad_accum_steps if name == "grad_accum_steps"
                 else "float16")
        raise ConfigError(
            f"{name}={value}: {cls.__name__} overrides train_step, which "
            f"does the {feature}; override compute_loss instead (the default "
            f"train_step then does it) or turn {feature} off")

  # --- The math: override these. -------------------------------------------

  def compute_loss(
      self, batch: Any) -> tuple[tf.Tensor, Mapping[str, tf.Tensor]]:
    """(loss, metrics) of one (micro-)batch on this replica: the override
    point. See the class docstring; runs under the gradient tape."""
    features, labels = batch
    logits = self.model(features, training=True)
    return self.loss_fn(labels, logits), {
        "accuracy": self.correct(labels, logits)}

  def train_step(self, batch: Any) -> dict[str, tf.Tensor]:
    """One step on this replica's part of the global batch.

    Returns:
      A dict of scalar shares whose SUM over replicas is the global value
      (use `average` for per-example values, `replica_share` for values that
      are already equal on every replica, such as a reduced gradient norm).
    """
    # This replica's share of the gradient (micro-batch by micro-batch).
    grads, metrics = self.accumulate_gradients(batch)
    # One SUM over replicas turns the shares into the gradient of the mean;
    # undo the float16 loss scale only after it (the scale is the same
    # everywhere, and the reduced gradient decides the skip on overflow).
    grads = self.unscale(self.all_reduce(grads))
    # Clip the global gradient; clipping shares would clip something else.
    grads, grad_norm = self.clip_by_global_norm(grads)
    self.apply_gradients(grads)
    return {**metrics, "grad_norm": self.replica_share(grad_norm)}

  def compute_gradients(self, batch):
    """(d loss_share / d weights, metric shares) for one (micro-)batch."""
    with tf.GradientTape() as tape:
      loss, metrics = self.loss_share(batch)
      # float16: scale up so that small gradients do not underflow.
      scaled_loss = self.scale_loss(loss)
    grads = tape.gradient(scaled_loss, self.model.trainable_variables)
    return grads, {"loss": loss, **metrics}

  def loss_share(self, batch):
    """(this replica's share of the loss, metric shares) of one (micro-)
    batch: `compute_loss` averaged over the global batch, plus the layer
    regularisers split over replicas and micro-batches."""
    loss, metrics = self.compute_loss(batch)
    loss = self._share(loss)
    # Layer regularisers are per model, not per example: split them evenly
    # over replicas and micro-batches.
    if self.model.losses:
      loss += tf.nn.scale_regularization_loss(
          tf.add_n(self.model.losses)) / self.grad_accum_steps
    return loss, {name: self._share(value)
                  for name, value in (metrics or {}).items()}

  def _share(self, value):
    """A scalar as it is (a share already); per-example values averaged."""
    value = tf.convert_to_tensor(value)
    if value.shape.rank == 0:
      return tf.cast(value, tf.float32)
    return self.average(value)

  def average(self, values: tf.Tensor) -> tf.Tensor:
    """This replica's share of the global-batch mean of `values` [batch, ...]."""
    values = tf.cast(values, tf.float32)
    if values.shape.rank and values.shape.rank > 1:
      # Each example's own mean, so that every element weighs the same.
      values = tf.reduce_mean(tf.reshape(values, [tf.shape(values)[0], -1]), 1)
    return tf.nn.compute_average_loss(
        values, global_batch_size=self.global_batch_size)

  def replica_share(self, value: tf.Tensor) -> tf.Tensor:
    """`value / replicas`: a value equal on all replicas, as a SUM-able share."""
    return tf.cast(value, tf.float32) / self.num_replicas

  @staticmethod
  def correct(labels: tf.Tensor, logits: tf.Tensor) -> tf.Tensor:
    """1.0 where the arg-max class equals the label, else 0.0."""
    predicted = tf.argmax(logits, axis=-1, output_type=tf.int32)
    return tf.cast(tf.equal(predicted, tf.cast(labels, tf.int32)), tf.float32)

  def request_stop(self) -> None:
    """Makes a running (or the next) training loop end after its current
    step; thread-safe, so a signal watcher thread may call it while the
    main thread is inside `train`. Under a multi-worker strategy, only call
    it on every worker at once (the loop's collectives need all of them)."""
    self.stop_requested.assign(True)

  def export_model(self) -> keras.Model:
    """The trained model as one plain Keras model (for weights files and
    exports); model-parallel trainers reassemble their split here."""
    return self.model

  def sync_replica_state(self) -> None:
    """Averages per-replica non-trainable state (BatchNorm moving
    statistics) before it is read or saved (`framework.core.replica_sync`)."""
    if self._sync_fn is None:
      self._sync_fn = replica_sync_fn(self.model, self.strategy)
    self._sync_fn()

  def averaged_weights(self):
    """A context in which the model holds its EMA weights (if any)."""
    return self.ema.swapped() if self.ema is not None else (
        contextlib.nullcontext())
