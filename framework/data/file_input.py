"""Streaming input from sharded files: deterministic, resumable, per-worker.

A `FileDataset` has the interface of an in-memory `ArrayDataset` that the
run needs (`input_shape`, `num_classes`, `class_names`, `label_shape`,
`num_train_examples`, `num_test_examples`, `test_samples(n)`) and builds its
own input pipelines (`train_dataset`, `distribute_train`, `eval_dataset`,
`distribute_eval`), which `framework.data.inputs` delegates to. Nothing of the
data is embedded in the graph; memory is bounded by a few shards.

Per input pipeline (one per worker under `distribute_datasets_from_function`):

  shards: with S >= P shards for P pipelines, pipeline i owns shards
    i, i + P, ... (file sharding: it opens nothing else). With S < P every
    pipeline reads every shard and keeps the examples at positions i mod P
    of the common stream (data sharding; a warning is logged).
  epoch e: the pipeline's shards are permuted by the stateless seed
    (seed, e) and cut into groups of `shards_per_group` consecutive shards;
    each group is read whole and its records permuted by a seed folded from
    (seed, e, group). The epoch is the concatenation of the groups, cut to
    `steps * batch` examples (the remainder is dropped, as in memory).
  shuffle="global" instead reads all of the pipeline's shards each epoch
    and orders their records as the in-memory arrays order examples: by
    the stateless uniform keys of (seed, e) at each record's example index.
    On one pipeline this IS the arrays' order, so the batches equal those
    of the same data in memory; memory holds the pipeline's encoded split.
  step s: epoch, offset = divmod(s, steps per epoch of this pipeline). A
    restart builds the stream from there: groups before the offset are not
    opened, and the group holding it is read and sliced, so resuming costs
    at most one group's read (`shards_per_group` shards), whatever the step.
  batches: consecutive examples of the stream, split into per-replica
    batches in replica order; examples decode in parallel with a
    deterministic order; augmentation seeds come from (seed, epoch, example
    index) exactly as for in-memory arrays.

So the batches are a pure function of (seed, step, files, number of input
pipelines, global batch size): the replica count within a worker does not
change them, the worker count does (see docs/guide/data.md).
"""


from absl import logging
import numpy as np
import tensorflow as tf

from framework.data import inputs
from framework.data.config import SHUFFLES
# ShardedSplit stays importable from here (its public home).
from framework.data.shard_order import ShardedSplit  # pylint: disable=unused-import
from framework.data.shard_order import epoch_records as _epoch_records
from framework.data.shard_order import (global_epoch_records as
                                        _global_epoch_records)
from framework.data.shard_order import plan as _plan
from framework.data.shard_order import shards_text as _shards_text
from framework.errors import ConfigError, DataError, check_positive
from framework.data.config import DatasetOptions, InputConfig
from framework.settings import default

_MAX_EPOCHS = 1 << 40
DEFAULT_SHARDS_PER_GROUP = 4


def _options():
  options = tf.data.Options()
  options.deterministic = True
  # Sharding is done here (by file or by element), never again by tf.data.
  options.experimental_distribute.auto_shard_policy = (
      tf.data.experimental.AutoShardPolicy.OFF)
  return options


def _to_float(images):
  from framework.data.inputs import to_float  # pylint: disable=g-import-not-at-top
  return to_float(images)


class FileDataset(inputs.ReadPerInputPipeline):
  """A dataset read from sharded files (TFRecords, an image folder)."""
  # Its records hold uint8 images (`prepare_features` divides them by 255).
  feature_dtype = "uint8"

  def __init__(self, name, train, test, *, class_names, image_shape,
               label_shape=(), shards_per_group=DEFAULT_SHARDS_PER_GROUP,
               shuffle=default(DatasetOptions, "file_shuffle"), generation=None):
    check_positive("shards_per_group", shards_per_group)
    if shuffle not in SHUFFLES:
      raise ConfigError(f"file_shuffle={shuffle!r} is not one of "
                        f"{', '.join(SHUFFLES)}")
    if shuffle == "global" and train.index is None:
      raise ConfigError(f"file_shuffle=global is not supported by {name} "
                        "(its records carry no example index)")
    self.shuffle = shuffle
    self.name = name
    self.train = train
    self.test = test
    self.class_names = tuple(class_names)
    self.input_shape = tuple(image_shape)
    self.label_shape = tuple(label_shape)
    self.shards_per_group = shards_per_group
    # The content's digest (`train/test` generations of a TFRecord set);
    # a run records it, so that resuming on re-converted data is an error.
    self.generation = generation

  @property
  def num_classes(self):
    return len(self.class_names)

  def prepare_features(self, features):
    """A batch of decoded features as the model takes them (uint8 images
    to float32 in [0, 1])."""
    return _to_float(features)

  @property
  def num_train_examples(self):
    return self.train.num_examples

  @property
  def num_test_examples(self):
    return self.test.num_examples

  def test_samples(self, n):
    """The first `n` test examples as numpy (images, labels)."""
    rows = list(self.test.read(tf.constant([0], tf.int64)).take(n).map(
        self.test.decode))
    return (np.stack([r[1].numpy() for r in rows]),
            np.stack([r[2].numpy() for r in rows]))

  # Training.

  def _train_stream(self, plan, seed, start_step):
    """(epoch, record) of one pipeline from global step `start_step` on."""
    start_epoch, offset = divmod(start_step, plan.steps)
    # In the common stream (before data sharding keeps 1 in keep_every).
    first_skip = offset * plan.stream_batch
    keep = plan.steps * plan.stream_batch

    # Decided where the pipeline is built (each worker, or a PS coordinator).
    label = None
    if logging.level_debug():
      label = f"{self.name} train: input pipeline {plan.pipeline_id}"

    def epoch_stream(epoch):
      skip = tf.where(epoch == start_epoch, tf.constant(first_skip, tf.int64),
                      tf.constant(0, tf.int64))
      if self.shuffle == "global":
        records = _global_epoch_records(self.train, plan.shard_ids, seed,
                                        epoch, skip)
      else:
        records = _epoch_records(self.train, plan.shard_ids, seed, epoch,
                                 skip, self.shards_per_group, label)
      records = records.take(keep - skip)
      return records.map(lambda r: (epoch, r))

    stream = tf.data.Dataset.range(start_epoch, _MAX_EPOCHS).flat_map(
        epoch_stream)
    if plan.keep_every > 1:
      # Epochs and the skip are multiples of keep_every: positions line up.
      stream = stream.shard(plan.keep_every, plan.pipeline_id)
    return stream

  def _train_pipeline(self, plan, batch_size, seed, start_step, augment):
    decode = self.train.decode

    def parse(epoch, record):
      index, image, label = decode(record)
      return epoch, index, image, label

    def finish(epoch, index, images, labels):
      images = self.prepare_features(images)
      if augment is not None:
        # As framework.data.inputs: seeds from (seed, epoch, example index).
        seeds = tf.stack([epoch * 1000003 + seed, index], axis=1)
        images, labels = augment(images, labels, seeds)
      return images, labels

    ds = self._train_stream(plan, seed, start_step)
    ds = ds.map(parse, num_parallel_calls=tf.data.AUTOTUNE)
    ds = ds.batch(batch_size, drop_remainder=True)
    ds = ds.map(finish, num_parallel_calls=tf.data.AUTOTUNE)
    return ds.prefetch(tf.data.AUTOTUNE).with_options(_options())

  def train_dataset(self, global_batch_size, *,
                    seed=default(InputConfig, "seed"), start_step=0,
                    augment=None):
    """Endless global batches from step `start_step` on (one pipeline)."""
    check_positive("global_batch_size", global_batch_size)
    plan = _plan(self.train, 1, 0, global_batch_size, self.name)
    return self._train_pipeline(plan, global_batch_size, seed, start_step,
                                augment)

  def train_dataset_fn(self, global_batch_size, *,
                       seed=default(InputConfig, "seed"), start_step=0,
                       augment=None):
    """A `distribute_datasets_from_function` argument (per-replica batches)."""
    check_positive("global_batch_size", global_batch_size)

    def dataset_fn(context):
      plan = _plan(self.train, context.num_input_pipelines,
                   context.input_pipeline_id, global_batch_size, self.name)
      return self._train_pipeline(
          plan, context.get_per_replica_batch_size(global_batch_size), seed,
          start_step, augment)

    return dataset_fn

  def per_worker_train_dataset_fn(self, num_workers, global_batch_size, *,
                                  seed=default(InputConfig, "seed"),
                                  start_step=0, augment=None):
    """A `ClusterCoordinator.create_per_worker_dataset` argument (PS).

    Under `ParameterServerStrategy` the `InputContext` always says one
    input pipeline, so the worker is told by
    `experimental_get_current_worker_index()`: worker i is input pipeline
    i of `num_workers`, with its shards (or, with fewer shards than workers,
    every `num_workers`-th example). Each worker's step takes a whole
    `global_batch_size` from its stream; it starts at its step
    `start_step // num_workers` (its share of the steps done, if the
    workers went equally fast). The plans are made here, the pipeline of
    the worker's index is picked when the function runs on a worker.
    """
    check_positive("global_batch_size", global_batch_size)
    check_positive("num_workers", num_workers)
    plans = [_plan(self.train, num_workers, i, global_batch_size, self.name,
                   pipeline_batch=global_batch_size)
             for i in range(num_workers)]
    branches = [
        lambda plan=plan: self._train_pipeline(
            plan, global_batch_size, seed, start_step // num_workers, augment)
        for plan in plans]

    def dataset_fn():
      index = tf.distribute.coordinator.experimental_get_current_worker_index()
      return tf.switch_case(tf.cast(index, tf.int32), branches)

    return dataset_fn

  # Evaluation: every example once over all pipelines, every batch full.

  def _eval_shards(self, num_pipelines, pipeline_id):
    """(shard ids, examples, data sharding?) of one pipeline's test part."""
    shards = len(self.test.counts)
    if shards >= num_pipelines:
      ids = list(range(pipeline_id, shards, num_pipelines))
      return ids, sum(self.test.counts[i] for i in ids), False
    return (list(range(shards)),
            len(range(pipeline_id, self.test.num_examples, num_pipelines)),
            True)

  def _eval_pipeline(self, num_pipelines, pipeline_id, batch_size,
                     local_replicas=1, pad=True):
    """Pipeline `pipeline_id`'s test examples in batches of `batch_size`.

    Padded (`pad`): `MaskedBatch`es, the last real batch padded, then
    all-padding batches until every pipeline has the same number of steps
    of `local_replicas` batches each (the batches of one step go to the
    pipeline's replicas): no replica ever gets an empty batch.
    """
    ids, examples, data_sharding = self._eval_shards(num_pipelines,
                                                     pipeline_id)
    shards = len(self.test.counts)
    if data_sharding:
      logging.warning("%s test split has %d shards for %d input pipelines: "
                      "data sharding", self.name, shards, num_pipelines)
    logging.info("%s test: input pipeline %d/%d reads shards %s, %d examples",
                 self.name, pipeline_id, num_pipelines,
                 _shards_text(ids, shards), examples)
    ds = self.test.read(tf.constant(ids, tf.int64))
    if data_sharding:
      ds = ds.shard(num_pipelines, pipeline_id)
    ds = ds.map(lambda r: self.test.decode(r)[1:],
                num_parallel_calls=tf.data.AUTOTUNE)
    ds = ds.batch(batch_size).map(lambda x, y: (self.prepare_features(x), y))
    if pad:
      batches = lambda n: -(-n // batch_size)
      steps = max(-(-batches(self._eval_shards(num_pipelines, p)[1])
                    // local_replicas) for p in range(num_pipelines))
      from framework.data.inputs import pad_batches  # pylint: disable=g-import-not-at-top
      ds = pad_batches(ds, batch_size,
                       steps * local_replicas - batches(examples))
    return ds.prefetch(tf.data.AUTOTUNE).with_options(_options())

  def eval_dataset(self, global_batch_size, *, pad=True):
    """One pass over the test split as one pipeline (see `_eval_pipeline`);
    `pad=False`: plain (x, y) batches, the last one partial."""
    check_positive("global_batch_size", global_batch_size)
    return self._eval_pipeline(1, 0, global_batch_size, pad=pad)

  def eval_dataset_fn(self, global_batch_size, *, pad=True):
    """A `distribute_datasets_from_function` argument: per-replica batches,
    padded so that every replica gets a full batch at every step."""
    check_positive("global_batch_size", global_batch_size)

    def dataset_fn(context):
      return self._eval_pipeline(
          context.num_input_pipelines, context.input_pipeline_id,
          context.get_per_replica_batch_size(global_batch_size),
          context.num_replicas_in_sync // context.num_input_pipelines, pad)

    return dataset_fn

  def distribute_eval(self, strategy, global_batch_size):
    return strategy.distribute_datasets_from_function(
        self.eval_dataset_fn(global_batch_size))


def tfrecord_split(data_dir, sidecar, split="split"):
  """A `ShardedSplit` over the shards a sidecar names (in `data_dir`, the
  folder holding the sidecar), checked as they stream: a shard that ends
  early, runs long or holds other records, and a record that does not match
  the sidecar, fail the pipeline with a message naming them (turned into a
  DataError by `framework.data.integrity.data_error`)."""
  import os  # pylint: disable=g-import-not-at-top
  from framework.data import tfrecords  # pylint: disable=g-import-not-at-top

  def index(records):
    return tf.io.parse_example(
        records, {"index": tf.io.FixedLenFeature([], tf.int64)})["index"]

  return ShardedSplit(
      tuple(sidecar["examples_per_shard"]),
      tfrecords.shard_reader(data_dir, sidecar),
      tfrecords.parse_fn(sidecar["image_shape"], sidecar["label_shape"],
                         len(sidecar["class_names"]),
                         os.path.join(data_dir, f"{split}.json")),
      index)


def load_tfrecord(data_dir, shards_per_group=DEFAULT_SHARDS_PER_GROUP,
                  shuffle=default(DatasetOptions, "file_shuffle")):
  """The `FileDataset` of a directory written by scripts/make_tfrecords.py
  (its current generation, resolved once: see framework/data/tfrecord_set.py).
  """
  from framework.data import tfrecord_set, tfrecords  # pylint: disable=g-import-not-at-top
  if not data_dir:
    raise ConfigError("dataset=tfrecord needs data_dir (a directory written "
                      "by scripts/make_tfrecords.py)")
  folder = tfrecord_set.resolve(data_dir)
  train = tfrecords.read_sidecar(folder, "train")
  test = tfrecords.read_sidecar(folder, "test")
  for key in ("image_shape", "label_shape", "class_names"):
    if train[key] != test[key]:
      raise DataError(f"data_dir={data_dir!r}: train and test {key} differ "
                      f"({train[key]} vs {test[key]})")
  generation = None
  if "generation" in train and "generation" in test:
    generation = f"{train['generation']}/{test['generation']}"
  return FileDataset(
      train.get("name", "tfrecord"), tfrecord_split(folder, train, "train"),
      tfrecord_split(folder, test, "test"), class_names=train["class_names"],
      image_shape=train["image_shape"], label_shape=train["label_shape"],
      shards_per_group=shards_per_group, shuffle=shuffle,
      generation=generation)


def _register():
  from framework.data import datasets  # pylint: disable=g-import-not-at-top
  datasets.DATASETS["tfrecord"] = (
      lambda data_dir=None, file_shuffle=default(
          DatasetOptions, "file_shuffle"), **_: load_tfrecord(
              data_dir, shuffle=file_shuffle))


_register()
