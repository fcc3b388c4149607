"""How the step's one gradient all-reduce goes over the wire.

    config = AllReduceConfig(bytes_per_pack=4 << 20, implementation="ring",
                             dtype="bfloat16")
    Trainer(..., all_reduce=config)

- `bytes_per_pack`, `implementation`: TensorFlow's
  `tf.distribute.experimental.CommunicationOptions`. The collective
  all-reduce (MultiWorkerMirroredStrategy) concatenates the gradients into
  packs of about `bytes_per_pack` bytes, one collective per pack (0: one
  pack for everything, TensorFlow's default); several packs can be in
  flight at once. `implementation`: `ring` (gRPC, CPU and GPU), `nccl`
  (GPUs only) or `auto` (TensorFlow chooses). The sum is the same either
  way; strategies without collectives (mirrored and central storage on
  CPU, parameter server) ignore both.
- `dtype="bfloat16"`: float32 gradients are rounded to bfloat16 before the
  reduction and cast back after it, so the wire carries half the bytes;
  the update is applied in float32. Each reduced value is the float32 sum
  within a relative error of about (replicas + 1) x 2^-8 (bfloat16 keeps 8
  significant bits).
- `overlap=True`: the gradients go out in buckets of about `bytes_per_pack`
  bytes (OVERLAP_BUCKET_BYTES if 0), last layer first, one all-reduce per
  bucket. A bucket's all-reduce depends only on its own gradients, so the
  runtime starts it while the backward pass is still computing the earlier
  layers' (Horovod's tensor fusion, PyTorch DDP's buckets). The sums are the
  same, element by element, as one all-reduce's.
"""

import dataclasses

import tensorflow as tf

from framework.core.config import (  # pylint: disable=unused-import
    ALL_REDUCE_DTYPES, ALL_REDUCE_IMPLEMENTATIONS, AllReduceConfig)

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


def all_reduce_sum(context, values, config=None):
  """SUM of `values` (a nest of tensors) over the replicas of `context` (a
  `tf.distribute.ReplicaContext`), in one all-reduce call, as `config`
  says (None: TensorFlow's defaults)."""
  sum_op = tf.distribute.ReduceOp.SUM
  if config is None or config.is_default:
    return context.all_reduce(sum_op, values)
  flat = tf.nest.flatten(values)
  if config.dtype == "bfloat16":
    wire = [tf.cast(v, tf.bfloat16) if v.dtype == tf.float32 else v
            for v in flat]
  else:
    wire = flat
  if config.overlap:
    reduced = _bucketed_all_reduce(context, wire, config)
  else:
    reduced = context.all_reduce(sum_op, wire,
                                 options=communication_options(config))
  reduced = [tf.cast(r, v.dtype) if r.dtype != v.dtype else r
             for r, v in zip(reduced, flat)]
  return tf.nest.pack_sequence_as(values, reduced)


def _bucketed_all_reduce(context, values, config):
  """One all-reduce per bucket (see `gradient_buckets`), issued in backward
  order; each is one pack (TensorFlow would otherwise re-pack it)."""
  options = communication_options(dataclasses.replace(config, bytes_per_pack=0))
  reduced = [None] * len(values)
  for bucket in gradient_buckets(
      values, config.bytes_per_pack or OVERLAP_BUCKET_BYTES):
    sums = context.all_reduce(tf.distribute.ReduceOp.SUM,
                              [values[i] for i in bucket], options=options)
    for i, value in zip(bucket, sums):
      reduced[i] = value
  return reduced
