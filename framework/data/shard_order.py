"""Which shards and records each input pipeline of a sharded split reads.

The order half of `framework.data.file_input` (see its docstring): a
pipeline's plan (file or data sharding, its batch per step and steps per
epoch) and the records of one of its epochs, by shard groups or in the
in-memory arrays' global order, from any position on. Pure functions of
(seed, epoch, shards, pipelines); `FileDataset` builds its pipelines on them.
"""

import dataclasses
import sys
from typing import Callable

from absl import logging
import tensorflow as tf

from framework.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class ShardedSplit:
  """One split stored as shards.

  Attributes:
    counts: examples in each shard, in shard order.
    read: `shard ids (int64 [k]) -> tf.data.Dataset` of the records of those
      shards, shard after shard, each shard in its stored order. A record
      is a tensor or a dict of tensors (not a tuple: it is mapped as one
      argument).
    decode: `record -> (index int64, image uint8 [H, W, C], label int32)`.
    index: `records (a batch) -> int64 [n]`, their example indices without
      decoding the images (for `shuffle="global"`); None: not supported.
  """
  counts: tuple
  read: Callable
  decode: Callable
  index: Callable = None

  @property
  def num_examples(self):
    return int(sum(self.counts))


@dataclasses.dataclass(frozen=True)
class Plan:
  """What one input pipeline reads (see the module docstring)."""
  shard_ids: tuple
  keep_every: int     # 1: file sharding; P: data sharding
  pipeline_id: int
  stream_batch: int   # examples of this pipeline's stream per global step
  steps: int          # global steps per epoch of this stream


def shards_text(ids, total):
  """`0,2,4 (3 of 6 shards)`; long lists cut after 8 ids."""
  shown = ",".join(map(str, ids[:8])) + (",..." if len(ids) > 8 else "")
  return f"{shown} ({len(ids)} of {total} shards)"


def plan(split, num_pipelines, pipeline_id, global_batch_size, name,
          pipeline_batch=None):
  """Pipeline `pipeline_id`'s part; `pipeline_batch`: its examples per step
  (default: global_batch_size / num_pipelines)."""
  shards = len(split.counts)
  if pipeline_batch is None:
    pipeline_batch = global_batch_size // num_pipelines
  if shards >= num_pipelines:
    ids = tuple(range(pipeline_id, shards, num_pipelines))
    keep_every, stream_batch = 1, pipeline_batch
  else:
    logging.warning(
        "%s has %d shards for %d input pipelines: every pipeline reads every "
        "shard and keeps 1/%d of the examples (data sharding); write at least "
        "%d shards (make_tfrecords.py --num_shards) to shard by file", name,
        shards, num_pipelines, num_pipelines, num_pipelines)
    ids = tuple(range(shards))
    keep_every, stream_batch = num_pipelines, pipeline_batch * num_pipelines
  examples = sum(split.counts[i] for i in ids)
  steps = examples // stream_batch
  logging.info("%s train: input pipeline %d/%d reads shards %s, %d examples",
               name, pipeline_id, num_pipelines, shards_text(ids, shards),
               examples // keep_every)
  if steps == 0:
    raise ConfigError(
        f"global_batch_size={global_batch_size} is too large: input pipeline "
        f"{pipeline_id} of {num_pipelines} has {examples} training examples "
        f"of {name}, fewer than its {stream_batch} per step")
  return Plan(ids, keep_every, pipeline_id, stream_batch, steps)


def global_epoch_records(split, shard_ids, seed, epoch, skip):
  """The records of `shard_ids` in the arrays' order of epoch `epoch`."""
  ids = tf.constant(shard_ids, tf.int64)
  key = tf.stack([tf.cast(seed, tf.int64), epoch])
  # framework.data.inputs orders example i of epoch e by keys[i]: the same
  # keys, restricted to this pipeline's examples.
  keys = tf.random.stateless_uniform([split.num_examples], seed=key)

  def order(records):
    # In index order first: float32 keys tie (~150 pairs in 50,000), and
    # argsort must see the keys exactly as the arrays' pipeline does.
    index = split.index(records)
    by_index = tf.argsort(index)
    rank = tf.gather(by_index, tf.argsort(tf.gather(
        keys, tf.gather(index, by_index))))
    return tf.nest.map_structure(lambda r: tf.gather(r, rank)[skip:], records)

  total = sum(split.counts[i] for i in shard_ids)
  return split.read(ids).batch(total).map(order).unbatch()


def epoch_records(split, shard_ids, seed, epoch, skip, shards_per_group,
                   label=None):
  """The records of one epoch of `shard_ids`, from position `skip` on.

  With `label` (a string), every group read prints `label read shards
  [ids]: n records` to the stderr of the task that reads it (debug).
  """
  ids = tf.constant(shard_ids, tf.int64)
  counts = tf.constant([split.counts[i] for i in shard_ids], tf.int64)
  num_groups = -(-len(shard_ids) // shards_per_group)
  key = tf.stack([tf.cast(seed, tf.int64), epoch])
  order = tf.argsort(tf.random.stateless_uniform([len(shard_ids)], seed=key))
  ids, counts = tf.gather(ids, order), tf.gather(counts, order)
  group_counts = tf.math.unsorted_segment_sum(
      counts, tf.range(len(shard_ids)) // shards_per_group, num_groups)
  ends = tf.cumsum(group_counts)
  starts = ends - group_counts

  def group(g):
    first = tf.maximum(skip - starts[g], 0)
    group_key = tf.random.experimental.stateless_fold_in(key, g + 1)

    def shuffle(records):
      # Records may be a structure (a dict of tensors), never a tuple.
      size = tf.shape(tf.nest.flatten(records)[0])[:1]
      if label is not None:
        with tf.control_dependencies([tf.print(
            label, "read shards", group_ids, ":", size[0], "records",
            output_stream=sys.stderr)]):
          size = tf.identity(size)
      order = tf.argsort(tf.random.stateless_uniform(size, seed=group_key))
      return tf.nest.map_structure(
          lambda r: tf.gather(r, order)[first:], records)

    group_ids = ids[g * shards_per_group:(g + 1) * shards_per_group]
    records = split.read(group_ids)
    return records.batch(group_counts[g]).map(shuffle).unbatch()

  # Groups wholly before `skip` are filtered on their counts: never opened.
  return tf.data.Dataset.range(num_groups).filter(
      lambda g: ends[g] > skip).flat_map(group)
