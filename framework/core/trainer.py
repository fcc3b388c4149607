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

`steps_per_loop` such steps run inside one `tf.function` call, so Python is not
on the per-step path. The loop also ends early, at the next step boundary,
when `request_stop` was called (preemption) or, under `nan_policy=skip`, once
`max_skipped_steps` steps in a row were skipped; `global_step` counts the
steps that ran.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, Mapping, Sequence

from absl import logging
import keras
import tensorflow as tf

from framework import _tf_internal
from framework.core import communication
from framework.core import summaries
from framework.core import tta
from framework.core.config import NAN_POLICIES
from framework.data.inputs import MaskedBatch
from framework.core.ema import WeightAverage
from framework.errors import ConfigError, check_choice, check_positive
from framework.core.fused_updates import fused_update

SUM = tf.distribute.ReduceOp.SUM
# What only the default `train_step` does, by the argument that turns it on.
STEP_FEATURES = {"grad_accum_steps": "gradient accumulation",
                 "loss_scale": "float16 loss scaling"}


def sparse_categorical_loss(labels: tf.Tensor,
                            logits: tf.Tensor) -> tf.Tensor:
  """Per-example (or per-pixel) cross-entropy from logits, in float32."""
  return keras.losses.sparse_categorical_crossentropy(
      labels, tf.cast(logits, tf.float32), from_logits=True)


class Trainer:
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
  regularisers (`model.losses`) and reports the total as `loss`. Options of
  a subclass are constructor keyword arguments, not class attributes.

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
    fused_updates: update each variable with TensorFlow's one-kernel
      optimizer op where there is one (Adam, AdamW, SGD; see
      `framework.core.fused_updates`), else the optimizer's `update_step`.
    ema_decay: keep an exponential moving average of the trainable weights
      (`framework.core.ema`), updated after each applied update; evaluation
      uses it. None: off.
    ema_warmup: the EMA's decay ramps up as min(decay, (1+n)/(10+n)).
    eval_tta: test-time augmentation in evaluation (`framework.core.tta`):
      `none` or `flip` (mean logits of each image and its mirror).
    all_reduce: a `framework.core.communication.AllReduceConfig` (packing,
      implementation, wire dtype of the gradient all-reduce); None: defaults.
  """

  def __init__(self, model: keras.Model,
               optimizer: keras.optimizers.Optimizer,
               strategy: tf.distribute.Strategy, *, global_batch_size: int,
               loss_fn: Callable[[tf.Tensor, tf.Tensor], tf.Tensor] = (
                   sparse_categorical_loss),
               clip_norm: float | None = None, nan_policy: str = "stop",
               grad_accum_steps: int = 1, loss_scale: Any = None,
               fused_updates: bool = True, max_skipped_steps: int = 10,
               ema_decay: float | None = None, ema_warmup: bool = False,
               eval_tta: str = "none", all_reduce: Any = None) -> None:
    check_positive("global_batch_size", global_batch_size)
    check_positive("max_skipped_steps", max_skipped_steps)
    check_positive("grad_accum_steps", grad_accum_steps)
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
    if clip_norm is not None and not clip_norm > 0:
      raise ConfigError(f"clip_norm={clip_norm} must be > 0 (or unset)")
    check_choice("nan_policy", nan_policy, NAN_POLICIES)
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
    self.ema = None
    if ema_decay is not None:
      self.ema = WeightAverage(model.trainable_variables, strategy, ema_decay,
                               warmup=ema_warmup)
    with strategy.scope():
      # Slots exist before tracing, so checkpoints restore into them eagerly.
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
    self._train_loop = tf.function(self._train_loop_fn)
    self._sync_fn = None
    self._eval_loop = tf.function(self._eval_loop_fn)

  # Features of STEP_FEATURES that a `train_step` override implements itself.
  train_step_handles = ()

  @property
  def num_replicas(self) -> int:
    return self.strategy.num_replicas_in_sync

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

  def eval_step(self, batch: Any,
                mask: tf.Tensor | None = None) -> dict[str, tf.Tensor]:
    """Sums over this replica's part of an evaluation batch.

    The one eval step of every task: `eval_logits` gives the outputs (TTA,
    or a split model's placed forward pass), `eval_sums` what is summed.

    Args:
      batch: `(features, labels)`, padded to its full size.
      mask: float32 [rows]: 1.0 for real examples, 0.0 for padding rows
        (None: every row is real). Every sum must leave padding out.

    Returns:
      A dict of sums; `examples` counts the real examples.
    """
    features, labels = batch
    logits = self.eval_logits(features)
    if _takes_mask(self.eval_sums):
      return self.eval_sums(labels, logits, mask=mask)
    # An override without `mask`: give it the real rows only (the model
    # already ran on the whole padded batch).
    _warn_no_mask(self.eval_sums)
    if mask is not None:
      labels, logits = real_rows((labels, logits), mask)
    return self.eval_sums(labels, logits)

  def eval_sums(self, labels: tf.Tensor, logits: tf.Tensor,
                mask: tf.Tensor | None = None) -> dict[str, tf.Tensor]:
    """Loss and accuracy summed over the real examples (a per-pixel value
    is first averaged over its example's pixels), and their count.

    `mask` (float32 [rows], 0.0 for padding; None: all real) weighs each
    example: an override passes it on to `super().eval_sums` and leaves the
    padding rows out of its own sums (`masked_sum`, or `weights=mask` in
    `tf.math.confusion_matrix`).
    """
    loss = _per_example(self.loss_fn(labels, logits))
    if mask is None:
      mask = tf.ones_like(loss)
    return {"loss": masked_sum(loss, mask),
            "accuracy": masked_sum(_per_example(self.correct(labels, logits)),
                                   mask),
            "examples": tf.reduce_sum(tf.cast(mask, tf.float32))}

  def run_eval_step(self, batch):
    """`eval_step` on one replica's batch (a `MaskedBatch` or a plain one).

    An `eval_step` override without a `mask` argument gets the real rows of
    a padded batch only (possibly 0 rows: add `mask=None` to it to keep the
    model's batch full and static).
    """
    mask = None
    if isinstance(batch, MaskedBatch):
      batch, mask = batch
    if _takes_mask(self.eval_step):
      return self.eval_step(batch, mask=mask)
    _warn_no_mask(self.eval_step)
    return self.eval_step(batch if mask is None else real_rows(batch, mask))

  def eval_logits(self, features: Any) -> tf.Tensor:
    """The model's outputs for evaluation (with `eval_tta` applied)."""
    return tta.eval_logits(self.model, features, self.eval_tta)

  def eval_results(self, totals: Mapping[str, Any]) -> dict[str, float]:
    """Turns the summed `eval_step` outputs into the reported metrics."""
    count = totals["examples"]
    results = {k: v / count for k, v in totals.items() if k != "examples"}
    results["examples"] = count
    return results

  # --- Helpers for train steps. ---------------------------------------------

  def accumulate_gradients(self, batch):
    """`compute_gradients` summed over `grad_accum_steps` micro-batches.

    Shares are already divided by the global batch size, so their sum over
    micro-batches is this replica's share of the whole batch; micro-batches
    run one after another, so only one micro-batch's activations are live.
    """
    k = self.grad_accum_steps
    if k == 1:
      return self.compute_gradients(batch)
    micro = tf.nest.map_structure(
        lambda t: tf.reshape(t, [k, -1] + t.shape[1:].as_list()), batch)
    micro_batch = lambda i: tf.nest.map_structure(lambda t: t[i], micro)
    grads, metrics = self.compute_gradients(micro_batch(0))
    for i in tf.range(1, k):
      more_grads, more_metrics = self.compute_gradients(micro_batch(i))
      grads = [g + h for g, h in zip(grads, more_grads)]
      metrics = {name: metrics[name] + more_metrics[name] for name in metrics}
    return grads, metrics

  def scale_loss(self, loss: tf.Tensor) -> tf.Tensor:
    """`loss` times the float16 loss scale (unchanged without one)."""
    return loss if self.loss_scale is None else self.loss_scale.scale_loss(loss)

  def unscale(self, grads: Sequence[tf.Tensor]) -> list[tf.Tensor]:
    """Reduced gradients divided by the loss scale (unchanged without one)."""
    return grads if self.loss_scale is None else self.loss_scale.unscale(grads)

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

  def all_reduce(self, values: Sequence[tf.Tensor]) -> list[tf.Tensor]:
    """SUM of `values` (a nest of tensors) over all replicas, in one call."""
    context = tf.distribute.get_replica_context()
    if context is None or self.num_replicas == 1:
      return values
    return communication.all_reduce_sum(context, values, self.communication)

  def clip_by_global_norm(
      self, grads: Sequence[tf.Tensor]) -> tuple[list[tf.Tensor], tf.Tensor]:
    """(grads clipped to `clip_norm`, their global norm before clipping)."""
    norm = tf.linalg.global_norm(grads)
    if self.clip_norm is None:
      return grads, norm
    clipped, _ = tf.clip_by_global_norm(grads, self.clip_norm, use_norm=norm)
    return clipped, norm

  def apply_gradients(self, grads: Sequence[tf.Tensor],
                      variables: Sequence[tf.Variable] | None = None) -> Any:
    """Applies already all-reduced `grads` once (call from `train_step`).

    Unlike Keras's `optimizer.apply_gradients`, this never all-reduces: it
    updates each variable's copies with the gradient already on their device
    and advances `optimizer.iterations` once.
    """
    variables = list(variables or self.model.trainable_variables)
    self._applied_in_trace = True
    if len(grads) != len(variables):
      raise ValueError(f"apply_gradients got {len(grads)} gradients for "
                       f"{len(variables)} variables")
    finite = tf.math.is_finite(tf.linalg.global_norm(grads))
    context = tf.distribute.get_replica_context()
    if isinstance(self.strategy,
                  tf.distribute.experimental.ParameterServerStrategy):
      # One replica per worker, and merge_call is not available there.
      return self._update(self.strategy, grads, variables, finite)
    return context.merge_call(self._update, args=(grads, variables, finite))

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
    """Averages per-replica non-trainable state (BatchNorm moving statistics).

    Keras 3 creates such variables with aggregation NONE, so each replica
    updates its own copy from its own part of the batch. Moving averages are
    linear in the batch statistics, so averaging the copies before they are
    read (evaluation, checkpoints) equals averaging every update.
    """
    if self._sync_fn is None:
      variables = [
          getattr(v, "value", v) for v in self.model.non_trainable_variables
          if "float" in str(v.dtype)
          and not _tf_internal.is_seed_generator_state(v)]
      variables = [v for v in variables
                   if isinstance(v, tf.distribute.DistributedValues)]
      if self.num_replicas == 1 or not variables or isinstance(
          self.strategy, tf.distribute.experimental.ParameterServerStrategy):
        self._sync_fn = lambda: None
      else:
        def replica_fn():
          context = tf.distribute.get_replica_context()
          means = context.all_reduce(tf.distribute.ReduceOp.MEAN,
                                     [v.read_value() for v in variables])
          for var, mean in zip(variables, means):
            var.assign(mean)

        self._sync_fn = tf.function(lambda: self.strategy.run(replica_fn))
    self._sync_fn()

  def update_variable(self, grad, var, learning_rate):
    """One variable's optimizer step with its reduced gradient.

    Called once per variable copy (inside `strategy.extended.update`), with
    `learning_rate` a tensor of `var`'s dtype; override to change where or
    how a variable is updated. Keras's order: decoupled weight decay (AdamW),
    then the step, as one fused kernel where TensorFlow has one
    (`framework.core.fused_updates`).
    """
    optimizer = self.optimizer
    weight_decay = getattr(optimizer, "weight_decay", None)
    if weight_decay and _tf_internal.uses_weight_decay(optimizer, var):
      var.assign_sub(var * tf.cast(weight_decay, var.dtype) * learning_rate)
    # One kernel per variable instead of Keras's chain of element-wise ops.
    # Chosen while tracing, from the optimizer the trainer has now (the
    # distribution check swaps in a probe and back).
    update_step = ((self.fused_updates and fused_update(optimizer))
                   or optimizer.update_step)
    return update_step(grad, var, learning_rate)

  # --- Internals. -----------------------------------------------------------

  def _update(self, strategy, grads, variables, finite):
    """Cross-replica: one optimizer update with the reduced gradients."""
    optimizer = self.optimizer

    def update_all():
      lr = optimizer.learning_rate

      def update_one(var, grad):
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

    if self.nan_policy != "skip" and self.loss_scale is None:
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
    applied = tf.cond(finite, apply, skip)
    if self.loss_scale is not None:
      with tf.control_dependencies([self.loss_scale.update(finite)]):
        applied = tf.identity(applied)
    return applied

  def _reduce(self, per_replica):
    return {k: self.strategy.reduce(SUM, v, axis=None)
            for k, v in per_replica.items()}

  def _one_step(self, iterator):
    self._applied_in_trace = False
    # tf.summary calls inside the step record at the step it ends at (the
    # Controller's train/ scalars use the same numbering).
    with summaries.default_step(self.global_step + 1):
      per_replica = self.strategy.run(self.train_step,
                                      args=(next(iterator),))
    if not self._applied_in_trace and (self.ema is not None
                                       or self.nan_policy == "skip"):
      # Raised by `train` once traced (autograph would re-wrap it here).
      feature = ("ema_decay (the EMA of the weights)" if self.ema is not None
                 else "nan_policy=skip")
      self._trace_error = (
          f"{feature}: {type(self).__name__}.train_step never calls "
          "self.apply_gradients, which does it; call it for the update or "
          "override compute_loss instead")
    metrics = self._reduce(per_replica)
    self.global_step.assign_add(1)
    return metrics

  def _keep_going(self):
    """Whether the loop may run another step (read before each step)."""
    keep_going = tf.logical_not(self.stop_requested)
    if self.nan_policy == "skip":
      keep_going = tf.logical_and(
          keep_going, self.consecutive_skips < self.max_skipped_steps)
    return keep_going

  def _train_loop_fn(self, iterator, num_steps):
    # The first step always runs, so that the metrics are never 0 / 0.
    totals = self._one_step(iterator)
    steps = tf.constant(1)
    while tf.logical_and(steps < num_steps, self._keep_going()):
      step_metrics = self._one_step(iterator)
      totals = {k: totals[k] + step_metrics[k] for k in totals}
      steps += 1
    return {k: v / tf.cast(steps, v.dtype) for k, v in totals.items()}

  def train(self, iterator: Any, num_steps: int) -> dict[str, Any]:
    """Runs `num_steps` steps in one graph call; returns their mean metrics.

    Fewer steps run when a stop was requested or, under `nan_policy=skip`,
    `max_skipped_steps` steps in a row were skipped: `global_step` tells how
    many ran.
    """
    num_steps = tf.constant(num_steps, tf.int32)
    # Traced before it runs, so that a step that would drop a feature
    # fails before it trains (the call reuses this trace).
    self._train_loop.get_concrete_function(iterator, num_steps)
    if self._trace_error:
      raise ConfigError(self._trace_error)
    return self._train_loop(iterator, num_steps)

  def _eval_totals(self, batch):
    totals = self._reduce(self.strategy.run(self.run_eval_step,
                                            args=(batch,)))
    return {k: tf.cast(v, tf.float64) for k, v in totals.items()}

  def _eval_loop_fn(self, iterator):
    totals = self._eval_totals(next(iterator))
    for batch in iterator:
      batch_totals = self._eval_totals(batch)
      totals = {k: totals[k] + batch_totals[k] for k in totals}
    return totals

  def averaged_weights(self):
    """A context in which the model holds its EMA weights (if any)."""
    return self.ema.swapped() if self.ema is not None else (
        contextlib.nullcontext())

  def evaluate(self, distributed_dataset: Any) -> dict[str, Any]:
    """Evaluates over the whole dataset (`MaskedBatch`es: padding rows
    left out of every sum; plain batches: every row), with the EMA weights
    when there is an EMA."""
    with self.averaged_weights():
      totals = self._eval_loop(iter(distributed_dataset))
    return {k: float(v) for k, v in
            self.eval_results({k: v.numpy() for k, v in totals.items()}).items()}


def masked_sum(values, mask):
  """Sum of `values` [rows] weighted by `mask` [rows]; padding rows (mask 0)
  count nothing even when their values are not finite. No mask: the sum."""
  values = tf.cast(values, tf.float32)
  if mask is None:
    return tf.reduce_sum(values)
  mask = tf.cast(mask, tf.float32)
  return tf.reduce_sum(tf.where(mask > 0, values * mask, 0.0))


def real_rows(batch, mask):
  """The rows of `batch` (a nest of tensors) whose `mask` is not 0."""
  keep = tf.cast(mask, tf.float32) > 0
  return tf.nest.map_structure(lambda t: tf.boolean_mask(t, keep), batch)


def _takes_mask(method):
  """Whether `method` accepts a `mask` keyword argument."""
  try:
    parameters = inspect.signature(method).parameters.values()
  except (TypeError, ValueError):
    return False
  return any(p.name == "mask" or p.kind == p.VAR_KEYWORD for p in parameters)


_WARNED = set()


def _warn_no_mask(method):
  """Once per method: an override without `mask` gets unpadded rows."""
  name = getattr(method, "__qualname__", repr(method))
  if name not in _WARNED:
    _WARNED.add(name)
    logging.warning(
        "%s takes no `mask` argument: it is given only the real rows of each "
        "padded evaluation batch (a dynamic shape, possibly 0 rows); add "
        "`mask=None` and leave rows with mask 0 out of its sums", name)


def _per_example(values):
  """Each example's mean over its trailing (pixel) dimensions."""
  values = tf.cast(values, tf.float32)
  if values.shape.rank > 1:
    values = tf.reduce_mean(tf.reshape(values, [tf.shape(values)[0], -1]), 1)
  return values
