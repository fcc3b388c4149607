"""The gradient pipeline of a step: accumulate, reduce, clip, apply, skip.

`Trainer.train_step` is these stages in order, each a method that a
`train_step` override may call on its own:

    grads, metrics = accumulate_gradients(batch)  # K micro-batches, summed
    grads = unscale(reduce_gradients(grads))       # one SUM over replicas
                                                   # (all-reduce, or ZeRO-1's
                                                   # reduce-scatter), then
                                                   # the float16 scale
    grads, norm = clip_by_global_norm(grads)       # the reduced gradient
    apply_gradients(grads)                         # one update, never
                                                   # reduced again; skipped
                                                   # when not finite
                                                   # (nan_policy=skip,
                                                   # float16 overflow); EMA

`GradientPipeline` is a mixin of `framework.Trainer`: it reads the
trainer's `trainable_variables`, `optimizer`, `grad_accum_steps`,
`clip_norm`, `communication`, `fused_updates` and `spikes`, and
`compute_gradients(batch)`. The update itself, with its skip, loss scale
and EMA, is the trainer's `updater`, one object of the kind the trainer
chose (`framework.core.updates`); `scale_loss`, `unscale`,
`apply_gradients`, `assign_weights` and `if_finite` call it.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

import tensorflow as tf

from framework.core import updates
from framework.core.config import (ALL_REDUCE_DTYPES, ALL_REDUCE_IMPLEMENTATIONS, AllReduceConfig)


class GradientPipeline:
  """The stages between a batch's loss and the one optimizer update."""

  # A float64 host variable summing the seconds this task's replicas spent
  # in the gradient all-reduce (its wait for the slowest task, and the
  # transfer), divided by its local replicas: the Controller splits each
  # worker's step time with it. None: not measured (one process).
  collective_wait_seconds = None
  _local_replicas = 1

  def accumulate_gradients(self, batch, reduce=None):
    """`compute_gradients` summed over `grad_accum_steps` micro-batches.

    Shares are already divided by the global batch size, so their sum over
    micro-batches is this replica's share of the whole batch; micro-batches
    run one after another, so only one micro-batch's activations are live.
    `reduce`: applied to each micro-batch's gradients before they are
    summed (ZeRO-2: `reduce_gradients`, a reduce-scatter, so that the sum
    holds only this replica's slices); None: the shares as computed.
    """
    k = self.grad_accum_steps
    if k == 1:
      grads, metrics = self.compute_gradients(batch)
      return (grads if reduce is None else reduce(grads)), metrics
    micro = tf.nest.map_structure(
        lambda t: tf.reshape(t, [k, -1] + t.shape[1:].as_list()), batch)
    micro_batch = lambda i: tf.nest.map_structure(lambda t: t[i], micro)
    grads, metrics = self.compute_gradients(micro_batch(0))
    if reduce is not None:
      return self._accumulate_reduced(micro_batch, reduce, reduce(grads),
                                      metrics)
    # An embedding lookup's gradient is IndexedSlices, which `+` does not
    # add; summed dense, it keeps one shape over the loop's iterations.
    grads = [_dense(g) for g in grads]
    for i in tf.range(1, k):
      more_grads, more_metrics = self.compute_gradients(micro_batch(i))
      grads = [g + _dense(h) for g, h in zip(grads, more_grads)]
      metrics = {name: metrics[name] + more_metrics[name] for name in metrics}
    return grads, metrics

  def _accumulate_reduced(self, micro_batch, reduce, grads, metrics):
    """`accumulate_gradients` with `reduce`, from micro-batch 0's reduced
    `grads` and its `metrics`. The micro-batches are unrolled (the CPU
    all-to-all of a reduce-scatter hangs inside a `tf.while_loop`), each
    computed only once the previous one is reduced, so that one
    micro-batch's activations and whole gradient are live at a time."""
    for i in range(1, self.grad_accum_steps):
      with tf.control_dependencies(tf.nest.flatten(grads)):
        more_grads, more_metrics = self.compute_gradients(micro_batch(i))
      grads = [g + h for g, h in zip(grads, reduce(more_grads))]
      metrics = {name: metrics[name] + more_metrics[name] for name in metrics}
    return grads, metrics

  def scale_loss(self, loss: tf.Tensor) -> tf.Tensor:
    """`loss` times the float16 loss scale (unchanged without one)."""
    return self.updater.scale_loss(loss)

  def unscale(self, grads: Sequence[tf.Tensor]) -> list[tf.Tensor]:
    """Reduced gradients divided by the loss scale (unchanged without one)."""
    return self.updater.unscale(grads)

  def all_reduce(self, values: Sequence[tf.Tensor]) -> list[tf.Tensor]:
    """SUM of `values` (a nest of tensors) over all replicas, in one call."""
    context = tf.distribute.get_replica_context()
    if context is None or self.num_replicas == 1:
      return values
    return self._timed(
        lambda v: all_reduce_sum(context, v, self.communication), values)

  def scatters_gradients(self) -> bool:
    """Whether `reduce_gradients` reduce-scatters (the update kind's
    `scatters()`: ZeRO-1 with the default all-reduce options): each replica
    then holds only its slice of the summed gradient."""
    return self.num_replicas > 1 and self.updater.scatters()

  def reduce_gradients(
      self, grads: Sequence[tf.Tensor]) -> list[tf.Tensor]:
    """The SUM over replicas of this replica's gradient shares, as the
    update kind takes it: whole (`all_reduce`) or, where
    `scatters_gradients()`, only this replica's slice of each (a
    reduce-scatter; pass the norm to `apply_gradients` as
    `scattered_norm`)."""
    if not self.scatters_gradients():
      return self.all_reduce(grads)
    return self._timed(self.updater.reduce_scatter, grads)

  def _timed(self, reduce, values):
    """`reduce(values)`, a collective, with this worker's wait for it added
    to `collective_wait_seconds` (where measured)."""
    if self.collective_wait_seconds is None:
      return reduce(values)
    # From this replica's gradients being ready to their sum: the values
    # are the same, the clock is only read (by the host: tf.timestamp is
    # refused under op determinism).
    with tf.control_dependencies(tf.nest.flatten(values)):
      ready = _host_clock()
    reduced = reduce(values)
    with tf.control_dependencies(tf.nest.flatten(reduced)):
      waited = _host_clock() - ready
    self.collective_wait_seconds.assign_add(waited / self._local_replicas)
    return reduced

  def clip_by_global_norm(
      self, grads: Sequence[tf.Tensor],
      scattered: bool = False) -> tuple[list[tf.Tensor], tf.Tensor]:
    """(grads clipped to `clip_norm`, their global norm before clipping).
    `scattered`: `grads` are this replica's slices (`reduce_gradients`
    where `scatters_gradients()`); the norm is still the whole gradient's
    (one scalar all-reduce of the slices' squares)."""
    norm = (scattered_global_norm(grads) if scattered
            else updates.global_norm(grads))
    if self.clip_norm is None:
      return grads, norm
    clipped, _ = tf.clip_by_global_norm(grads, self.clip_norm, use_norm=norm)
    return clipped, norm

  def spike_signals(self, loss_share: tf.Tensor,
                    grad_norm: tf.Tensor) -> Any:
    """What `apply_gradients` judges a spike on (`framework.core.spikes`):
    (the global loss, summed from this replica's `loss_share`; the reduced
    gradient's norm before clipping), or None under `spike_policy=none`
    (then no op is added)."""
    if getattr(self, "spikes", None) is None:
      return None
    loss = tf.cast(loss_share, tf.float32)
    context = tf.distribute.get_replica_context()
    if context is not None and self.num_replicas > 1:
      loss = context.all_reduce(tf.distribute.ReduceOp.SUM, loss)
    return loss, tf.cast(grad_norm, tf.float32)

  def apply_gradients(self, grads: Sequence[tf.Tensor],
                      variables: Sequence[tf.Variable] | None = None, *,
                      spike_signals: Any = None,
                      scattered_norm: tf.Tensor | None = None) -> Any:
    """Applies already all-reduced `grads` once (call from `train_step`) to
    `variables` (default: the trainer's `trainable_variables`).

    Unlike Keras's `optimizer.apply_gradients`, this never all-reduces: it
    updates each variable's copies with the gradient already on their device
    and advances `optimizer.iterations` once. `spike_signals`: the step's
    `spike_signals(...)`; under `spike_policy` skip or rollback a spike
    drops the update (a `train_step` override passes them).
    `scattered_norm`: `grads` are this replica's slices from
    `reduce_gradients` (ZeRO-1) and this the whole gradient's norm.
    """
    variables = list(variables or self.trainable_variables)
    if spike_signals is not None or getattr(self, "spikes", None) is None:
      self._applied_in_trace = True
    elif not self._trace_error:
      self._trace_error = (
          f"spike_policy={self.spike_policy}: {type(self).__name__}."
          "train_step calls self.apply_gradients without spike_signals=self."
          "spike_signals(loss, grad_norm); pass them, or override "
          "compute_loss instead")
    if spike_signals is None:
      spike_signals = ()
    if len(grads) != len(variables):
      raise ValueError(f"apply_gradients got {len(grads)} gradients for "
                       f"{len(variables)} variables")
    return self.updater.apply(grads, variables, spike_signals,
                              scattered_norm=scattered_norm)

  def assign_weights(self, weights, variables, finite, spike_signals=()):
    """Sets `variables` to `weights`, updated elsewhere (gathered from the
    optimizer's shards), as one step: the step count, the EMA and the skip
    counters as in `apply_gradients`, with `assign` as the update."""
    self._applied_in_trace = True
    return self.updater.assign(weights, variables, finite, spike_signals)

  def if_finite(self, finite, update, spike=None):
    """`update()` (it returns a bool tensor), under `nan_policy=skip` or a
    float16 loss scale only where `finite` (else False), and never on a
    `spike`."""
    return self.updater.if_finite(finite, update, spike)

  def update_variable(self, grad, var, learning_rate):
    """One variable's optimizer step with its reduced gradient.

    Called once per variable copy (inside `strategy.extended.update`), with
    `learning_rate` a tensor of `var`'s dtype; override to change where or
    how a variable is updated. Keras's order: decoupled weight decay (AdamW),
    then the step, as one fused kernel where TensorFlow has one
    (`framework.core.optimizers`).
    """
    # Chosen while tracing, from the optimizer the trainer has now (the
    # distribution check swaps in a probe and back).
    return updates.update_variable(self.optimizer, grad, var, learning_rate,
                                   fused=self.fused_updates)


# How the step's one gradient all-reduce goes over the wire.
#
#     config = AllReduceConfig(bytes_per_pack=4 << 20, implementation="ring",
#                              dtype="bfloat16")
#     Trainer(..., all_reduce=config)
#
# - `bytes_per_pack`, `implementation`: TensorFlow's
#   `tf.distribute.experimental.CommunicationOptions`. The collective
#   all-reduce (MultiWorkerMirroredStrategy) concatenates the gradients into
#   packs of about `bytes_per_pack` bytes, one collective per pack (0: one
#   pack for everything, TensorFlow's default); several packs can be in
#   flight at once. `implementation`: `ring` (gRPC, CPU and GPU), `nccl`
#   (GPUs only) or `auto` (TensorFlow chooses). The sum is the same either
#   way; strategies without collectives (mirrored and central storage on
#   CPU, parameter server) ignore both.
# - `dtype="bfloat16"`: float32 gradients are rounded to bfloat16 before the
#   reduction and cast back after it, so the wire carries half the bytes;
#   the update is applied in float32. Each reduced value is the float32 sum
#   within a relative error of about (replicas + 1) x 2^-8 (bfloat16 keeps 8
#   significant bits).
# - `overlap=True`: the gradients go out in buckets of about `bytes_per_pack`
#   bytes (OVERLAP_BUCKET_BYTES if 0), last layer first, one all-reduce per
#   bucket. A bucket's all-reduce depends only on its own gradients, so the
#   runtime starts it while the backward pass is still computing the earlier
#   layers' (Horovod's tensor fusion, PyTorch DDP's buckets). The sums are the
#   same, element by element, as one all-reduce's.
# AllReduceConfig lives in framework/core/config.py (no TensorFlow there:
# the flags are made from it); importable from here too.
IMPLEMENTATIONS = ALL_REDUCE_IMPLEMENTATIONS
DTYPES = ALL_REDUCE_DTYPES

_IMPLEMENTATION = {
    "auto": tf.distribute.experimental.CommunicationImplementation.AUTO,
    "ring": tf.distribute.experimental.CommunicationImplementation.RING,
    "nccl": tf.distribute.experimental.CommunicationImplementation.NCCL,
}


# PyTorch DDP's first bucket; small enough that the seed CNN (6.8 MB of
# float32 gradients) goes out in several.
OVERLAP_BUCKET_BYTES = 1 << 20


def gradient_buckets(values, bucket_bytes):
  """Indices of `values` in buckets, in backward order: the last value (the
  last layer's gradient, computed first by the backward pass) in the first
  bucket; a bucket is full once it holds `bucket_bytes` bytes."""
  buckets, bucket, size = [], [], 0
  for i in reversed(range(len(values))):
    elements = values[i].shape.num_elements()
    bucket.append(i)
    size += bucket_bytes if elements is None else (
        elements * values[i].dtype.size)
    if size >= bucket_bytes:
      buckets.append(bucket)
      bucket, size = [], 0
  if bucket:
    buckets.append(bucket)
  return buckets


def communication_options(config):
  """`config`'s `tf.distribute.experimental.CommunicationOptions`."""
  return tf.distribute.experimental.CommunicationOptions(
      bytes_per_pack=config.bytes_per_pack,
      implementation=_IMPLEMENTATION[config.implementation])


def scattered_global_norm(slices: Sequence[tf.Tensor]) -> tf.Tensor:
  """The global norm of a gradient whose replicas each hold `slices` of it
  (replica context): the square root of the SUM over replicas of their
  squares (zero padding adds nothing)."""
  squares = tf.add_n([tf.reduce_sum(tf.square(tf.cast(g, tf.float32)))
                      for g in slices])
  return tf.sqrt(tf.distribute.get_replica_context().all_reduce(
      tf.distribute.ReduceOp.SUM, squares))


def _host_clock():
  """The host's wall clock in seconds (float64), read when the op runs."""
  return tf.numpy_function(time.time, [], tf.float64, stateful=True)


def all_reduce_sum(context, values, config=None):
  """SUM of `values` (a nest of tensors) over the replicas of `context` (a
  `tf.distribute.ReplicaContext`), in one all-reduce call, as `config`
  says (None: TensorFlow's defaults)."""
  flat = tf.nest.flatten(values)
  if config is None or config.is_default:
    return tf.nest.pack_sequence_as(values, _all_reduce_by_dtype(context, flat))
  if config.dtype == "bfloat16":
    wire = [tf.cast(v, tf.bfloat16) if v.dtype == tf.float32 else v
            for v in flat]
  else:
    wire = flat
  if config.overlap:
    reduced = _bucketed_all_reduce(context, wire, config)
  else:
    reduced = _all_reduce_by_dtype(context, wire,
                                   options=communication_options(config))
  reduced = [tf.cast(r, v.dtype) if r.dtype != v.dtype else r
             for r, v in zip(reduced, flat)]
  return tf.nest.pack_sequence_as(values, reduced)


def _all_reduce_by_dtype(context, values, options=None):
  """SUM of the tensors `values` over the replicas of `context`: one
  all-reduce call per dtype, in order of first appearance (one call where
  all share a dtype). TensorFlow's collective all-reduce concatenates a
  call's tensors, so a model with float16 or float64 variables beside
  float32 ones would fail in one call."""
  groups = {}
  for i, value in enumerate(values):
    groups.setdefault(value.dtype, []).append(i)
  reduced = [None] * len(values)
  for indices in groups.values():
    sums = context.all_reduce(tf.distribute.ReduceOp.SUM,
                              [values[i] for i in indices], options=options)
    for i, value in zip(indices, sums):
      reduced[i] = value
  return reduced


def _bucketed_all_reduce(context, values, config):
  """One all-reduce per bucket (see `gradient_buckets`), issued in backward
  order; each is one pack (TensorFlow would otherwise re-pack it)."""
  options = communication_options(dataclasses.replace(config, bytes_per_pack=0))
  reduced = [None] * len(values)
  for bucket in gradient_buckets(
      values, config.bytes_per_pack or OVERLAP_BUCKET_BYTES):
    sums = _all_reduce_by_dtype(context, [values[i] for i in bucket],
                                options=options)
    for i, value in zip(bucket, sums):
      reduced[i] = value
  return reduced


def _dense(grad):
  """`grad` as a dense tensor where it is IndexedSlices."""
  if isinstance(grad, tf.IndexedSlices):
    return tf.convert_to_tensor(grad)
  return grad
