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

This module holds the step's own parts: the losses, `replica_sync_fn`
(BatchNorm statistics averaged over replicas), `StepLoop` (`steps_per_loop`
steps in one `tf.function` call, ending early at a stop request or too many
skips), the XLA compilation of the step (`jit_compile`) and `Trainer`
itself. Its other mixins live beside it: `gradients.py` (accumulate,
reduce, clip, apply) and `evaluation.py` (the masked evaluation sums); the
update with its skip, loss scale and EMA is one object of the kind the
trainer chose at construction, `updater` (`updates.py`).
"""

from __future__ import annotations

import contextlib
import functools
import re
from typing import Any, Callable, Mapping

from absl import logging
import keras
import tensorflow as tf

from framework import _tf_internal
from framework.core import (evaluation, layer_norms, optimizer_sharding,
                            spikes, summaries, updates, weight_decay)
from framework.core.checkpoints import manager as checkpoint_manager
from framework.core.config import TrainerConfig, check_gradient_sharding
from framework.core.evaluation import Evaluating, masked_sum, real_rows
from framework.core.gradients import GradientPipeline
from framework.core.optimizers import WeightAverage
from framework.errors import ConfigError, check_positive
from framework.settings import default


# The in-graph step loop of a Trainer: `steps_per_loop` steps per call.
#
#     train(iterator, n):                 # one tf.function call
#       metrics = one step                # always, so the mean is never 0 / 0
#       while steps < n and keep_going:   # keep_going: no stop requested and,
#         metrics += one step             # under nan_policy=skip, fewer than
#                                         # max_skipped_steps skips in a row
#       return metrics / steps            # global_step counts what ran
#
#     one step = run_step(next(iterator)):  SUM over replicas of
#                distributed_train_step(batch); global_step += 1
#
# The first step and the loop body call the step through one nested
# tf.function (`_loop_step`: all of it but the SUM), so it is traced once.
#
# Python is not on the per-step path. `StepLoop` is a mixin of
# `framework.Trainer`; it reads the trainer's `strategy`, `global_step`,
# `stop_requested`, `nan_policy`, the skip counters, `ema`, `loss_scale`,
# `model`, `optimizer` and `train_step`.
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


# Per-example losses for `Trainer(loss_fn=...)`.
#
# A Trainer averages per-example losses over the *global* batch itself (see
# `Trainer.average`), so these return one value per example (or per pixel) and
# never reduce: a Keras loss object would divide by the replica count.
def check_batch_split(global_batch_size, strategy):
  """Raises ConfigError unless the global batch splits evenly over the
  strategy's replicas (made once, by the Trainer, before anything is
  written to a run's model_dir)."""
  replicas = strategy.num_replicas_in_sync
  if global_batch_size % replicas:
    raise ConfigError(
        f"global_batch_size={global_batch_size} is not divisible by the "
        f"{replicas} replicas of {type(strategy).__name__}; use a multiple "
        f"of {replicas}")


def smoothed_sparse_categorical_loss(label_smoothing):
  """`(labels, logits) -> per-example cross-entropy` with label smoothing.

  The target is `(1 - s) * one_hot(label) + s / K` over the K classes, as in
  `keras.losses.CategoricalCrossentropy(label_smoothing=s)` on one-hot
  labels, computed in float32 from integer labels of any shape (one per
  example, or one per pixel):

      loss = -(1 - s) * log_softmax(logits)[label] - s/K * sum(log_softmax)

  Args:
    label_smoothing: s in [0, 1); 0 is the plain sparse cross-entropy.
  """
  if not 0 <= label_smoothing < 1:
    raise ConfigError(f"label_smoothing={label_smoothing} must be in [0, 1)")
  smoothing = float(label_smoothing)

  def loss_fn(labels, logits):
    log_probs = tf.nn.log_softmax(tf.cast(logits, tf.float32), axis=-1)
    labels = tf.cast(labels, tf.int32)
    if labels.shape.rank == log_probs.shape.rank:  # [..., 1] labels
      labels = tf.squeeze(labels, -1)
    true_term = -tf.gather(log_probs, labels[..., None], axis=-1,
                           batch_dims=labels.shape.rank)[..., 0]
    uniform_term = -tf.reduce_mean(log_probs, axis=-1)
    return (1.0 - smoothing) * true_term + smoothing * uniform_term

  loss_fn.label_smoothing = smoothing
  return loss_fn


# Averaging per-replica non-trainable state before it is read or saved.
#
# Keras 3 creates non-trainable variables (BatchNorm moving statistics) with
# aggregation NONE, so each replica updates its own copy from its own part of
# the batch. Moving averages are linear in the batch statistics, so averaging
# the copies before they are read (evaluation, checkpoints) equals averaging
# every update.
def replica_sync_fn(model: keras.Model,
                    strategy: tf.distribute.Strategy) -> Callable[[], None]:
  """A function that sets every replica's copy of `model`'s float
  non-trainable variables to their mean (a no-op where there is nothing to
  average: one replica, no such variables, a parameter-server strategy)."""
  variables = [
      getattr(v, "value", v) for v in model.non_trainable_variables
      if "float" in str(v.dtype) and not _tf_internal.is_seed_generator_state(v)]
  variables = [v for v in variables
               if isinstance(v, tf.distribute.DistributedValues)]
  if strategy.num_replicas_in_sync == 1 or not variables or isinstance(
      strategy, tf.distribute.experimental.ParameterServerStrategy):
    return lambda: None

  def replica_fn():
    context = tf.distribute.get_replica_context()
    means = context.all_reduce(tf.distribute.ReduceOp.MEAN,
                               [v.read_value() for v in variables])
    for var, mean in zip(variables, means):
      var.assign(mean)

  return tf.function(lambda: strategy.run(replica_fn))


def _check_no_constraints(model):
  """Refuses weights with a Keras constraint (`kernel_constraint=...`).

  Keras applies them in `optimizer.apply`; the step's update is distloop's
  own (`framework.core.updates`, sharded or not) and does not, so such a
  model would train without them, silently.
  """
  constrained = [
      f"{getattr(v, 'path', v.name)} ({type(v.constraint).__name__})"
      for v in model.trainable_variables
      if getattr(v, "constraint", None) is not None]
  if constrained:
    raise ConfigError(
        f"the model's weights {', '.join(constrained)} have a constraint "
        "(kernel_constraint, bias_constraint, ...), which the train step's "
        "update does not apply; build the model without constraints")


class StepLoop:
  """`train(iterator, num_steps)` over the trainer's `train_step`."""

  # The compiled replica step under jit_compile (framework/core/trainer.py).
  _replica_step = None
  jit_compile = None

  def _reduce(self, per_replica):
    return {k: self.strategy.reduce(SUM, v, axis=None)
            for k, v in per_replica.items()}

  def distributed_train_step(self, dist_batch: Any) -> dict[str, Any]:
    """`train_step` on every replica's part of `dist_batch`: the per-replica
    outputs, before their SUM (what the loop and the distribution check
    both run)."""
    step = self._replica_step or self.train_step  # XLA-compiled or not
    return self.strategy.run(step, args=(dist_batch,))

  def run_step(self, dist_batch: Any) -> tuple[Any, dict[str, Any]]:
    """One training step on a distributed batch, as the loop runs it.

    Advances `global_step`. The distribution check calls it too, so that it
    checks the loop's own step rather than a copy.

    Returns:
      (the per-replica outputs of `distributed_train_step`, their SUM over
      replicas: the step's metrics).
    """
    per_replica = self._advance(dist_batch)
    return per_replica, self._reduce(per_replica)

  def _advance(self, dist_batch):
    """`run_step` but the SUM: the per-replica outputs; `global_step` + 1."""
    self._applied_in_trace = False
    # tf.summary calls inside the step record at the step it ends at (the
    # Controller's train/ scalars use the same numbering).
    with summaries.default_step(self.global_step + 1):
      per_replica = self.distributed_train_step(dist_batch)
    # An error `apply_gradients` already gave (e.g. no spike_signals) says
    # more than "never calls".
    if not self._applied_in_trace and not self._trace_error and (
        self.ema is not None or self.nan_policy == "skip"
        or self.spike_policy != "none"):
      # Raised by `train` once traced (autograph would re-wrap it here).
      feature = ("ema_decay (the EMA of the weights)" if self.ema is not None
                 else "nan_policy=skip" if self.nan_policy == "skip"
                 else f"spike_policy={self.spike_policy}")
      self._trace_error = (
          f"{feature}: {type(self).__name__}.train_step never calls "
          "self.apply_gradients, which does it; call it for the update or "
          "override compute_loss instead")
    self.global_step.assign_add(1)
    return per_replica

  def step_variables(self) -> list[Any]:
    """Every variable one step may change: the model's, the optimizer's,
    the tracked models' it trains, the EMA's, the float16 loss scale's, the skip counters and
    `global_step` (what the distribution check puts back afterwards)."""
    state = list(self.model.variables) + list(self.optimizer.variables)
    # The tracked models the default step trains (their BatchNorm
    # statistics too).
    state += [v for _, layer, _ in getattr(self, "_trained_tracked", ())
              for v in layer.variables]
    # The update's own: the EMA, the loss scale, spikes, skip counters.
    return state + self.updater.state_variables() + [self.global_step]

  def _loop_step_fn(self, iterator):
    return self._advance(next(iterator))

  def _one_step(self, iterator):
    # `_loop_step` is one nested tf.function for the loop's first step and
    # its body, so the step is traced once, not twice (tracing is most of
    # the time a short run takes). The SUM stays outside it, in the loop's
    # own graph, where it always was: the metrics keep their last bit.
    return self._reduce(self._loop_step(iterator))

  def _keep_going(self):
    """Whether the loop may run another step (read before each step)."""
    keep_going = tf.logical_not(self.stop_requested)
    if self.nan_policy == "skip":
      keep_going = tf.logical_and(
          keep_going, self.consecutive_skips < self.max_skipped_steps)
    if self.spike_policy == "rollback":  # the Controller rolls back first
      keep_going = tf.logical_and(keep_going, self.spikes.pending == 0)
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
    if not self.jit_compile:
      return self._train_loop(iterator, num_steps)
    try:  # XLA compiles at the first call
      return self._train_loop(iterator, num_steps)
    except (tf.errors.InvalidArgumentError, tf.errors.UnimplementedError) as e:
      line = compile_error(e)
      if line is None:
        raise
      raise ConfigError(line) from None


# `jit_compile`: the replica step compiled with XLA where TensorFlow can.
#
#     one replica (default, one_device)     the whole replica step: forward,
#                                           backward, clip and the update
#     several replicas (mirrored,           each replica's forward and backward
#     multi_worker_mirrored,                pass (`compute_gradients`); the
#     central_storage)                      all-reduce and the one update stay
#                                           outside XLA
#     tpu                                   compiled by the TPU strategy already
#     parameter_server, model parallel      not compiled (one warning line)
#
# Why not the whole step under several replicas: the update is one
# `merge_call` (the trainer applies the all-reduced gradient once), and
# TensorFlow does not allow that synchronisation point inside a nested
# `tf.function`, which an XLA function inside `strategy.run` is. The gradient
# computation is where nearly all the arithmetic is, so it is what XLA fuses.
#
# An op that XLA cannot compile (no XLA kernel on this device) fails the first
# call; `compile_error` turns TensorFlow's message into one line naming it.
STEP = "step"            # the whole replica step
GRADIENTS = "gradients"  # forward and backward of each replica


def _spans_workers(strategy):
  """Whether `strategy` is a MultiWorkerMirroredStrategy over a cluster of
  several tasks (where a slow task makes the others wait)."""
  if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
    return False
  resolver = strategy.cluster_resolver
  spec = resolver.cluster_spec().as_dict() if resolver is not None else {}
  return sum(len(spec.get(role, ())) for role in ("chief", "worker")) > 1


def _strategy_name(strategy):
  return type(strategy).__name__


def jit_mode(jit_compile, strategy):
  """STEP, GRADIENTS or None: what of the step XLA compiles under
  `strategy`; logs one line saying so (a warning where it cannot)."""
  if not jit_compile:
    return None
  name = _strategy_name(strategy)
  if isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy):
    logging.warning(
        "jit_compile: not supported under %s (its workers read variables on "
        "the parameter servers, outside any one XLA device); training "
        "without XLA", name)
    return None
  if isinstance(strategy, tf.distribute.TPUStrategy):
    logging.info("jit_compile: %s compiles the whole step with XLA already",
                 name)
    return None
  # Mirrored kinds run each replica in a thread of its own and synchronise
  # them in merge_call, even with one device.
  mirrored = (tf.distribute.MirroredStrategy,
              tf.distribute.MultiWorkerMirroredStrategy,
              tf.distribute.experimental.CentralStorageStrategy)
  if strategy.num_replicas_in_sync == 1 and not isinstance(strategy,
                                                           mirrored):
    logging.info("jit_compile: the whole replica step (forward, backward, "
                 "update) is compiled with XLA under %s", name)
    return STEP
  logging.info(
      "jit_compile: each replica's forward and backward pass is compiled "
      "with XLA under %s (%d replicas); the all-reduce and the update stay "
      "outside it (TensorFlow allows no merge_call inside a nested XLA "
      "function)", name, strategy.num_replicas_in_sync)
  return GRADIENTS


def compiled(fn):
  """`fn` as a `tf.function(jit_compile=True)`."""
  return tf.function(fn, jit_compile=True)


def compiled_step(trainer):
  """`trainer.train_step` compiled, for `strategy.run`.

  The step loop calls it once per step of its body, but Python traces it
  once: what the trace saw (`apply_gradients` called) is replayed on every
  call, so that the loop's feature check sees it each time.
  """
  traced = {}

  def step(batch):
    outputs = trainer.train_step(batch)
    traced["applied"] = trainer._applied_in_trace  # pylint: disable=protected-access
    return outputs

  jitted = compiled(step)

  def replica_step(batch):
    outputs = jitted(batch)
    if traced.get("applied"):
      trainer._applied_in_trace = True  # pylint: disable=protected-access
    return outputs

  return replica_step


_UNSUPPORTED = re.compile(
    r"(?:Detected unsupported operations when trying to compile graph"
    r"|No registered '(\w+)' OpKernel for XLA_\w+"
    r"|XLA compilation requires)", re.S)


def compile_error(error):
  """One line for an XLA compilation failure (None if `error` is another
  error): the ops XLA lacks, and what to do."""
  text = str(error)
  if not _UNSUPPORTED.search(text):
    return None
  ops = sorted(set(re.findall(r"No registered '(\w+)' OpKernel", text)) |
               set(re.findall(r"\b(\w+) \(No registered", text)))
  what = (f"the step's op{'s' if len(ops) > 1 else ''} {', '.join(ops)} "
          "ha" + ("ve" if len(ops) > 1 else "s") + " no XLA kernel here"
          if ops else "XLA cannot compile the step (" +
          text.strip().splitlines()[0][:200] + ")")
  return f"jit_compile: {what}; run without jit_compile"


def _knows(optimizer, variables):
  """Whether `optimizer` was built over any of `variables`."""
  for v in variables:
    try:
      _tf_internal.optimizer_variable_index(optimizer, v)
      return True
    except KeyError:
      pass
  return False


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

  A model that is not a classifier (an autoencoder, a regression) sets the
  class attribute `task = "custom"`: `compute_loss` then defines the loss
  from whatever the batch holds (the features alone for unlabeled data),
  and evaluation reports the mean of `eval_loss`'s loss and metrics.

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
    spike_policy: `none`, `skip` (a step whose global loss or gradient norm
      is above `spike_factor` times the median of the last `spike_window`
      steps' changes nothing, counted) or `rollback` (that too, and the
      controller restores the last checkpoint and skips the batches since
      it): `framework.core.spikes`.
    spike_factor, spike_window: what a spike is (see `spike_policy`).
    grad_accum_steps: split each replica's batch into this many micro-batches
      and sum their gradients before the one all-reduce and update: the same
      update as the whole batch at 1/grad_accum_steps of the activations.
    loss_scale: a `framework.core.precision.LossScale` (float16 training), or None.
    fused_updates: update with TensorFlow's one-kernel optimizer ops where
      there is one (`framework.core.optimizers`), else `update_step`.
    ema_decay: keep an exponential moving average of the trainable weights
      (`framework.core.optimizers`) after each applied update, which evaluation
      uses. None: off.
    ema_warmup: the EMA's decay ramps up as min(decay, (1+n)/(10+n)).
    eval_tta: test-time augmentation in evaluation (`framework.core.evaluation`):
      `none` or `flip` (mean logits of each image and its mirror).
    all_reduce: a `framework.core.gradients.AllReduceConfig` (packing,
      implementation, wire dtype of the gradient all-reduce); None: defaults.
    jit_compile: compile the replica step with XLA where TensorFlow can
      (`framework.core.trainer`: the whole step on one replica, each replica's
      forward and backward pass under several; a warning where it cannot).
    shard_optimizer_state: each replica keeps and updates 1/N of the
      optimizer's slots (`framework.core.optimizer_sharding`, ZeRO-1) under
      (multi-worker) mirrored strategies; one replica: no change.
    shard_gradients: with `shard_optimizer_state`, each replica also holds
      only its 1/N of the reduced gradient, and under `grad_accum_steps`
      accumulates only that (ZeRO-2, `updates.ShardedGradientsUpdate`);
      needs the default `all_reduce` options.
    weight_decay_exclude: the optimizer's weight decay (AdamW's, or any
      Keras optimizer's `weight_decay`) leaves out the variables whose path
      matches this pattern; None: those of fewer than 2 dimensions (biases,
      norms) and embedding tables (`framework.core.weight_decay`).
    log_layer_norms: the default `train_step` writes each layer's gradient
      norm, weight norm and update/weight ratio on the summary steps
      (`framework.core.layer_norms`); off: no op of it in the step.
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
               spike_policy: str = _default("spike_policy"),
               spike_factor: float = _default("spike_factor"),
               spike_window: int = _default("spike_window"),
               ema_decay: float | None = _default("ema_decay"),
               ema_warmup: bool = _default("ema_warmup"),
               eval_tta: str = _default("eval_tta"),
               all_reduce: Any = _default("all_reduce"),
               jit_compile: bool = _default("jit_compile"),
               shard_optimizer_state: bool = _default(
                   "shard_optimizer_state"),
               shard_gradients: bool = _default("shard_gradients"),
               weight_decay_exclude: str | None = _default(
                   "weight_decay_exclude"),
               log_layer_norms: bool = _default("log_layer_norms")) -> None:
    check_positive("global_batch_size", global_batch_size)
    TrainerConfig(  # checks the step settings, one ConfigError naming one
        clip_norm=clip_norm, nan_policy=nan_policy,
        max_skipped_steps=max_skipped_steps, grad_accum_steps=grad_accum_steps,
        ema_decay=ema_decay, eval_tta=eval_tta, spike_policy=spike_policy,
        spike_factor=spike_factor, spike_window=spike_window,
        weight_decay_exclude=weight_decay_exclude)
    _check_no_constraints(model)
    replicas = strategy.num_replicas_in_sync
    check_gradient_sharding(shard_gradients, shard_optimizer_state,
                            all_reduce)
    check_batch_split(global_batch_size, strategy)
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
    self.spike_policy = spike_policy
    self.log_layer_norms = log_layer_norms
    self.shard_gradients = shard_gradients
    self.eval_tta = evaluation.check_tta(eval_tta)
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
      self.weight_decay_exclude = weight_decay_exclude
      self._group_weight_decay(list(model.trainable_variables))
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
      # The spike window and counts (checkpointed); None: no spike check,
      # and not one op more in the step.
      self.spikes = None if spike_policy == "none" else spikes.SpikeWindow(
          spike_factor, spike_window, spike_policy)
    # Read by the training loop before every step and set from another
    # thread (a signal watcher) while the loop runs: one host variable,
    # outside the strategy, so that no replica copies can disagree.
    with tf.device("CPU:0"):
      self.stop_requested = tf.Variable(False, trainable=False,
                                        name="stop_requested")
    if _spans_workers(strategy):  # each worker's step time, split
      with tf.device("CPU:0"):
        self.collective_wait_seconds = tf.Variable(
            0.0, dtype=tf.float64, trainable=False,
            name="collective_wait_seconds")
      self._local_replicas = len(strategy.extended.worker_devices)
    # The one update path of this run, chosen once (`framework.core.updates`).
    self.updater = self._make_updater(
        optimizer=lambda: self.optimizer,
        update_variable=lambda grad, var, lr: self.update_variable(
            grad, var, lr),
        global_step=self.global_step, skipped_steps=self.skipped_steps,
        consecutive_skips=self.consecutive_skips, nan_policy=nan_policy,
        loss_scale=loss_scale, ema=self.ema, spikes=self.spikes,
        on_assign=self._note_applied)
    if (self.updater.scatters_micro_batches
        and self.optimizer_sharding is not None):
      sharding = self.optimizer_sharding
      logging.info(
          "shard_gradients: each replica accumulates and updates with %d of "
          "the gradient's %d bytes (ZeRO-2 over %d replicas)",
          sum(s.shape[0] * tf.as_dtype(s.dtype).size
              for s in sharding.shards),
          sum(tf.TensorShape(v.shape).num_elements()
              * tf.as_dtype(v.dtype).size for v in sharding.variables),
          replicas)
    self._check_step_features()
    # Set by `apply_gradients` while a step is traced (see `_one_step`).
    self._applied_in_trace = False
    self._trace_error = None
    # What XLA compiles (framework/core/trainer.py): the replica step (then
    # `distributed_train_step` runs `_replica_step`) or its gradients.
    self.jit_compile = jit_mode(jit_compile, strategy)
    if log_layer_norms and self.jit_compile == STEP:
      raise ConfigError(
          "log_layer_norms=True: the step XLA compiles whole here "
          "(jit_compile on one replica) cannot write summaries; turn "
          "jit_compile or log_layer_norms off")
    if log_layer_norms and type(self).train_step is not Trainer.train_step:
      logging.warning("log_layer_norms: %s overrides train_step, which "
                      "writes them; no layer norms are written",
                      type(self).__name__)
    self._replica_step = None  # None: `train_step` as it is at each trace
    if self.jit_compile == STEP:
      self._replica_step = compiled_step(self)
    elif self.jit_compile == GRADIENTS:
      self.compute_gradients = compiled(self.compute_gradients)
    self._loop_step = tf.function(self._loop_step_fn)
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

    A value is a keras.Model, layer, optimizer, `keras.Variable`,
    `tf.Variable` or `tf.Module`, or a list, tuple or dict (string keys) of
    them, checkpointed element by element. `__init__` does not run under
    `strategy.scope()`: create them in `with self.strategy.scope():` (an
    optimizer built there, `opt.build(variables)`, so that a resume
    restores its slots), then track them.

    Raises ConfigError, in one line, for a name the checkpoint itself uses
    (distloop's `model`, `optimizer`, `global_step`, ..., and
    `tf.train.Checkpoint`'s `save`, `restore`, `save_counter`, ...), a value
    a checkpoint cannot hold (an int, a string, an array, a function), a
    variable created outside the scope or an optimizer not yet built.
    """
    reserved = checkpoint_manager.reserved_names()
    for name, value in objects.items():
      where = f"{type(self).__name__}.track({name}=...)"
      if name in reserved:
        raise checkpoint_manager.reserved_name_error(where, name)
      for label, element in checkpoint_manager.tracked_elements(
          value, name, where):
        self._check_trackable(where, label, element, whole=label == name)
    self.tracked_objects = dict(self.tracked_objects, **objects)
    trained = self._tracked_trainable()
    if [id(v) for _, _, vs in trained for v in vs] != [
        id(v) for v in self.trainable_variables[
            len(self.model.trainable_variables):]]:
      self._build_optimizer_over(trained, where)

  # The tracked models and layers the default step trains, and the
  # trainable weights each adds: [(label, layer, [variable])].
  _trained_tracked = ()

  def _tracked_trainable(self):
    """[(label, layer, its new trainable weights)] of every tracked keras Layer or
    Model that the default step trains: under the default `train_step`
    only, not frozen (`trainable = False`), with no tracked optimizer of
    its own (that optimizer's step, e.g. a GAN's generator, updates it)."""
    if type(self).train_step is not Trainer.train_step:
      return []
    elements = [element for name, value in self.tracked_objects.items()
                for element in checkpoint_manager.tracked_elements(value, name)]
    optimizers = [obj for _, obj in elements
                  if isinstance(obj, keras.optimizers.Optimizer)
                  and obj is not self.optimizer]
    seen = {id(v) for v in self.model.trainable_variables}
    trained = []
    for label, obj in elements:
      if not isinstance(obj, keras.layers.Layer):
        continue
      weights = [v for v in obj.trainable_variables if id(v) not in seen]
      if not weights:
        continue
      if any(_knows(o, weights) for o in optimizers):
        # The default step never applies that optimizer: said once, so a
        # model meant to train is not silently left as it was built.
        logging.warning(
            "%s.track(%s=...): its trainable weights have an optimizer of "
            "their own tracked beside it, which the default train_step "
            "does not apply (it trains with the run's optimizer): it stays "
            "as it is unless your code applies that optimizer; drop the "
            "optimizer to train it with the run's, or freeze it "
            "(trainable = False)", type(self).__name__, label)
        continue
      seen.update(id(v) for v in weights)
      trained.append((label, obj, weights))
    return trained

  def _build_optimizer_over(self, trained, where):
    """Builds the run's optimizer again over the model's and `trained`'s
    weights (its slots then checkpoint and restore with the run's)."""
    if int(self.optimizer.iterations.numpy()):
      raise ConfigError(
          f"{where}: the default train_step would train it with the run's "
          "optimizer, which has already taken steps; track it before the "
          "first step (in __init__)")
    variables = list(self.model.trainable_variables) + [
        v for _, _, vs in trained for v in vs]
    with self.strategy.scope():
      _tf_internal.unbuild_optimizer(self.optimizer)
      if self.optimizer_sharding is not None:
        self.optimizer_sharding = optimizer_sharding.ShardedOptimizerState(
            self.optimizer, self.strategy, variables)
        self.updater.sharding = self.optimizer_sharding
      else:
        self.optimizer.build(variables)
    self._group_weight_decay(variables)
    self._trained_tracked = tuple(trained)

  def _group_weight_decay(self, variables):
    """The optimizer's weight-decay groups over `variables` (and their
    ZeRO-1 shards), logged once."""
    sharding = self.optimizer_sharding
    decisions = weight_decay.group(
        self.optimizer, variables, self.weight_decay_exclude,
        followers=[sharding.shards] if sharding is not None else [])
    weight_decay.log_groups(self.optimizer, variables, decisions)

  def _check_trackable(self, where, label, value, whole):
    """Raises ConfigError unless `value` (the tracked value if `whole`,
    else the element `label` of a tracked list, tuple or dict) can be
    checkpointed and restored under this trainer's strategy."""
    its = "its" if whole else f"{label}: its"
    if not isinstance(value, _tf_internal.Trackable):
      kind = type(value)
      kind = (kind.__name__ if kind.__module__ == "builtins"
              else f"{kind.__module__.split('.')[0]}.{kind.__qualname__}")
      raise ConfigError(
          f"{where}: {'the value' if whole else label} has type {kind}, "
          "which a checkpoint cannot hold; track "
          "a keras.Model, layer, optimizer, keras.Variable, tf.Variable or "
          "tf.Module, or a list, tuple or dict of them")
    if isinstance(value, keras.optimizers.Optimizer) and not value.built:
      raise ConfigError(f"{where}: {'the optimizer' if whole else label} is "
                        f"not built; call {label}.build(variables) under "
                        "self.strategy.scope() before tracking it")
    if isinstance(value, (tf.Variable, keras.Variable)):
      variables = [value]
    else:  # a model, layer, optimizer or tf.Module
      variables = getattr(value, "variables", None) or ()
    for v in variables:
      # A keras.Variable holds the tf.Variable the strategy made as `value`
      # (a tf.Variable's `value` is a method).
      held = v.value if isinstance(v, keras.Variable) else v
      if (isinstance(held, tf.Variable) and
          not self.strategy.extended.variable_created_in_scope(held)):
        raise ConfigError(
            f"{where}: {its} variable "
            f"{v.name!r} was created outside strategy.scope(); create it "
            f"under `with self.strategy.scope():` in __init__ (under "
            f"{type(self.strategy).__name__} each replica needs its copy)")

  def _note_applied(self):
    """The step being traced has its update (see `_advance`)."""
    self._applied_in_trace = True

  def _make_updater(self, **parts: Any) -> updates.MergeCallUpdate:
    """The update kind of this run (`framework.core.updates.choose`);
    `parts`: what every kind holds. A trainer with another kind of update
    overrides this."""
    # ZeRO-1's reduce-scatter sums as the default all-reduce does; other
    # all-reduce options (bfloat16 on the wire, buckets) keep the all-reduce.
    communication = self.communication
    return updates.choose(self.strategy, sharding=self.optimizer_sharding,
                          scatter=communication is None
                          or communication.is_default,
                          shard_gradients=self.shard_gradients, **parts)

  @property
  def trainable_variables(self) -> list[Any]:
    """What the default step trains with the run's optimizer: the model's
    trainable weights, then those of each tracked keras Model or Layer
    that is trainable and has no tracked optimizer of its own (a
    `train_step` override: the model's alone)."""
    return list(self.model.trainable_variables) + [
        v for _, _, vs in self._trained_tracked for v in vs]

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
    # ZeRO-1: each replica receives only its slice of the sum.
    scattered = self.scatters_gradients()
    # One SUM over replicas turns the shares into the gradient of the mean;
    # undo the float16 loss scale only after it (the scale is the same
    # everywhere, and the reduced gradient decides the skip on overflow).
    if scattered and self.updater.scatters_micro_batches:
      # ZeRO-2: each micro-batch's gradient reduce-scattered as it comes,
      # only this replica's slices accumulated.
      grads, metrics = self.accumulate_gradients(
          batch, reduce=self.reduce_gradients)
    else:
      # This replica's share of the gradient (micro-batch by micro-batch).
      grads, metrics = self.accumulate_gradients(batch)
      grads = self.reduce_gradients(grads)
    grads = self.unscale(grads)
    # Clip the global gradient; clipping shares would clip something else.
    grads, grad_norm = self.clip_by_global_norm(grads, scattered=scattered)
    with (layer_norms.recorded(grads, self.trainable_variables,
                               scattered=scattered)
          if self.log_layer_norms else contextlib.nullcontext()):
      self.apply_gradients(grads, spike_signals=self.spike_signals(
          metrics["loss"], grad_norm),
                           scattered_norm=grad_norm if scattered else None)
    return {**metrics, "grad_norm": self.replica_share(grad_norm)}

  def compute_gradients(self, batch):
    """(d loss_share / d weights, metric shares) for one (micro-)batch."""
    with tf.GradientTape() as tape:
      loss, metrics = self.loss_share(batch)
      # float16: scale up so that small gradients do not underflow.
      scaled_loss = self.scale_loss(loss)
    grads = tape.gradient(scaled_loss, self.trainable_variables)
    return self._check_tracked_gradients(grads), {"loss": loss, **metrics}

  def _check_tracked_gradients(self, grads):
    """`grads`; a tracked model that the loss does not reach is an error
    (raised by `train` once traced) and its missing gradients zeros."""
    grads = list(grads)
    start = len(self.model.trainable_variables)
    for label, _, weights in self._trained_tracked:
      mine = grads[start:start + len(weights)]
      missing = sum(g is None for g in mine)
      if missing and not self._trace_error:
        reaches = ("reaches none" if missing == len(weights)
                   else f"does not reach {missing}")
        self._trace_error = (
            f"{type(self).__name__}.track({label}=...): the loss {reaches} "
            f"of its {len(weights)} trainable weights, which the default "
            "train_step trains with the run's optimizer; use it in "
            f"compute_loss, freeze it ({label}.trainable = False) or "
            "track an optimizer of its own beside it and override "
            "train_step")
      grads[start:start + len(weights)] = [
          tf.zeros_like(v) if g is None else g for g, v in zip(mine, weights)]
      start += len(weights)
    return grads

  def loss_share(self, batch):
    """(this replica's share of the loss, metric shares) of one (micro-)
    batch: `compute_loss` averaged over the global batch, plus the layer
    regularisers split over replicas and micro-batches."""
    loss, metrics = self.compute_loss(batch)
    loss = self._share(loss)
    # Layer regularisers are per model, not per example: split them evenly
    # over replicas and micro-batches.
    losses = list(self.model.losses) + [
        l for _, layer, _ in self._trained_tracked for l in layer.losses]
    if losses:
      loss += tf.nn.scale_regularization_loss(
          tf.add_n(losses)) / self.grad_accum_steps
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
    statistics) before it is read or saved (`framework.core.trainer`)."""
    if self._sync_fn is None:
      self._sync_fn = replica_sync_fn(self.model, self.strategy)
    self._sync_fn()

  def averaged_weights(self):
    """A context in which the model holds its EMA weights (if any)."""
    return self.ema.swapped() if self.ema is not None else (
        contextlib.nullcontext())
