"""Deterministic, resumable input pipelines and their distribution.

Training batches are a pure function of (seed, step): epoch `e` is a stateless
shuffle seeded by (seed, e), so a run restarted at step `s` builds the stream
from `s` on instead of replaying or checkpointing an iterator (distributed
iterators cannot be checkpointed under every strategy). The same global batch
goes to the replicas whether the input is distributed with
`experimental_distribute_dataset` (`input_mode="global"`) or built per input
pipeline with `distribute_datasets_from_function` (`input_mode="per_replica"`).

Evaluation batches are `MaskedBatch`es: every batch (the last one too) has
its full size, its padding rows are zeros with mask 0, and every replica
gets a full batch at every step (see `pad_batches`), so no model ever sees
a batch of 0 rows and shapes stay static (as TPUs need).
"""

import collections

import tensorflow as tf

from framework.data.config import INPUT_MODES, InputConfig
from framework.errors import ConfigError, check_choice, check_positive
from framework.settings import default

_MAX_EPOCHS = 1 << 40


def to_float(images):
  """uint8 images to float32 in [0, 1]; float features pass through."""
  if images.dtype == tf.uint8:
    return tf.cast(images, tf.float32) / 255.0
  return tf.cast(images, tf.float32)


def steps_per_epoch(num_examples, global_batch_size):
  """Full global batches per epoch (training drops the remainder)."""
  steps = num_examples // global_batch_size
  if steps == 0:
    raise ConfigError(f"global_batch_size={global_batch_size} is larger than "
                      f"the {num_examples} training examples")
  return steps


def _index_batches(num_examples, global_batch_size, seed, start_step):
  """(epoch, indices [global_batch_size]) from global step `start_step` on."""
  per_epoch = steps_per_epoch(num_examples, global_batch_size)
  start_epoch, offset = divmod(start_step, per_epoch)

  def epoch_batches(epoch):
    keys = tf.random.stateless_uniform(
        [num_examples], seed=tf.stack([tf.cast(seed, tf.int64), epoch]))
    order = tf.argsort(keys)[:per_epoch * global_batch_size]
    batches = tf.reshape(tf.cast(order, tf.int64), [per_epoch, -1])
    return tf.data.Dataset.from_tensor_slices(batches).map(
        lambda idx: (epoch, idx))

  epochs = tf.data.Dataset.range(start_epoch, _MAX_EPOCHS)
  # Skipping index batches is cheap: no image is gathered for them.
  return epochs.flat_map(epoch_batches).skip(offset)


def element_sharded_options():
  """Deterministic tf.data options sharding in-memory rows by element."""
  options = tf.data.Options()
  options.deterministic = True
  # In-memory arrays have no files to shard: shard by element.
  options.experimental_distribute.auto_shard_policy = (
      tf.data.experimental.AutoShardPolicy.DATA)
  return options


def _gather_fn(dataset, seed, augment):
  images = tf.constant(dataset.train_x)
  labels = tf.constant(dataset.train_y)

  def gather(epoch, idx):
    x = to_float(tf.gather(images, idx))
    y = tf.gather(labels, idx)
    if augment is not None:
      # Per-example seeds depend on (seed, epoch, example) only, so every
      # replica count and input mode augments an example identically.
      seeds = tf.stack([tf.fill(tf.shape(idx), epoch * 1000003 + seed), idx],
                       axis=1)
      x, y = augment(x, y, seeds)
    return x, y

  return gather


def train_dataset(dataset, global_batch_size, *,
                  seed=default(InputConfig, "seed"), start_step=0,
                  augment=None):
  """Infinite dataset of global batches, starting at global step `start_step`.

  Args:
    dataset: an `ArrayDataset`.
    augment: optional `(images, labels, seeds [batch, 2]) -> (images, labels)`
      using stateless random ops seeded per example.
  """
  check_positive("global_batch_size", global_batch_size)
  if hasattr(dataset, "train_dataset"):  # File-backed: it streams itself.
    return dataset.train_dataset(global_batch_size, seed=seed,
                                 start_step=start_step, augment=augment)
  ds = _index_batches(len(dataset.train_x), global_batch_size, seed,
                      start_step)
  ds = ds.map(_gather_fn(dataset, seed, augment),
              num_parallel_calls=tf.data.AUTOTUNE)
  return ds.prefetch(tf.data.AUTOTUNE).with_options(element_sharded_options())


def per_replica_train_fn(dataset, global_batch_size, *,
                         seed=default(InputConfig, "seed"), start_step=0,
                         augment=None):
  """A `distribute_datasets_from_function` argument giving the same batches."""

  def dataset_fn(context):
    replicas = context.num_replicas_in_sync
    per_replica = context.get_per_replica_batch_size(global_batch_size)
    per_pipeline = replicas // context.num_input_pipelines
    first = context.input_pipeline_id * per_pipeline
    ds = _index_batches(len(dataset.train_x), global_batch_size, seed,
                        start_step)

    def my_rows(epoch, idx):
      rows = tf.reshape(idx, [replicas, per_replica])[first:first +
                                                      per_pipeline]
      return tf.fill([per_pipeline], epoch), rows

    ds = ds.map(my_rows).unbatch()
    ds = ds.map(_gather_fn(dataset, seed, augment),
                num_parallel_calls=tf.data.AUTOTUNE)
    return ds.prefetch(tf.data.AUTOTUNE).with_options(element_sharded_options())

  return dataset_fn


MaskedBatch = collections.namedtuple("MaskedBatch", ["batch", "mask"])
MaskedBatch.__doc__ = """An evaluation batch padded to its full size.

`batch`: the batch as the dataset gives it (e.g. `(features, labels)`);
`mask`: float32 [rows], 1.0 for a real example, 0.0 for a padding row (a
row of zeros). `Trainer.eval_step` gets the two apart."""


def _zeros_like_spec(spec, rows):
  """Zeros of `spec` (a TensorSpec with a batch dimension) with `rows` rows."""
  shape = spec.shape[1:]
  if not shape.is_fully_defined():
    raise ValueError(f"cannot pad batches of shape {spec.shape}: every "
                     "dimension but the first must be known")
  return tf.zeros([rows] + shape.as_list(), spec.dtype)


def pad_batches(dataset, batch_size, extra_batches=0):
  """`dataset`'s batches padded to `batch_size` rows, as `MaskedBatch`es.

  Args:
    dataset: batches of at most `batch_size` rows (any structure; every
      component has the batch as its first dimension).
    batch_size: rows of every padded batch (a static shape).
    extra_batches: all-padding batches appended (so that every replica, or
      every input pipeline, gets the same number of full batches).
  """
  check_positive("batch_size", batch_size)
  spec = dataset.element_spec
  unpack = type(spec) is tuple  # pylint: disable=unidiomatic-typecheck

  def pad(*batch):
    batch = batch if unpack else batch[0]
    rows = tf.shape(tf.nest.flatten(batch)[0])[0]

    def pad_one(t):
      zeros = tf.zeros(tf.concat([[batch_size - rows], tf.shape(t)[1:]], 0),
                       t.dtype)
      return tf.ensure_shape(tf.concat([t, zeros], 0),
                             [batch_size] + t.shape[1:].as_list())

    return MaskedBatch(tf.nest.map_structure(pad_one, batch),
                       tf.sequence_mask(rows, batch_size, tf.float32))

  padded = dataset.map(pad)
  if extra_batches:
    empty = MaskedBatch(
        tf.nest.map_structure(lambda s: _zeros_like_spec(s, batch_size), spec),
        tf.zeros([batch_size], tf.float32))
    padded = padded.concatenate(
        tf.data.Dataset.from_tensors(empty).repeat(extra_batches))
  return padded


def eval_dataset(images, labels, global_batch_size, *, pad=True):
  """One pass over (images, labels): `MaskedBatch`es of `global_batch_size`
  rows, the last one padded (`pad=False`: plain (x, y) batches, the last
  one partial)."""
  check_positive("global_batch_size", global_batch_size)
  ds = tf.data.Dataset.from_tensor_slices((images, labels))
  ds = ds.batch(global_batch_size).map(lambda x, y: (to_float(x), y))
  if pad:
    ds = pad_batches(ds, global_batch_size)
  return ds.prefetch(tf.data.AUTOTUNE).with_options(element_sharded_options())


class ReadPerInputPipeline:
  """A dataset that builds its training batches per input pipeline (its
  `train_dataset_fn(global_batch_size, seed=, start_step=, augment=)`), in
  both input modes: files, numpy arrays read by slices, mixtures."""

  def distribute_train(self, strategy, global_batch_size, *,
                       seed=default(InputConfig, "seed"), start_step=0,
                       augment=None,
                       input_mode=default(InputConfig, "input_mode")):
    """The distributed training dataset, per input pipeline whatever
    `input_mode` says (the same global batches in both modes)."""
    del input_mode
    return strategy.distribute_datasets_from_function(self.train_dataset_fn(
        global_batch_size, seed=seed, start_step=start_step, augment=augment))


def distribute_train(strategy, dataset, global_batch_size, *,
                     seed=default(InputConfig, "seed"), start_step=0,
                     augment=None,
                     input_mode=default(InputConfig, "input_mode")):
  """The distributed training dataset for `strategy` (see INPUT_MODES)."""
  check_choice("input_mode", input_mode, INPUT_MODES)
  kwargs = dict(seed=seed, start_step=start_step, augment=augment)
  if hasattr(dataset, "distribute_train"):  # `ReadPerInputPipeline`
    return dataset.distribute_train(strategy, global_batch_size,
                                    input_mode=input_mode, **kwargs)
  if input_mode == "per_replica":
    return strategy.distribute_datasets_from_function(
        per_replica_train_fn(dataset, global_batch_size, **kwargs))
  return strategy.experimental_distribute_dataset(
      train_dataset(dataset, global_batch_size, **kwargs))


def distribute_eval(strategy, images, labels, global_batch_size):
  """The distributed evaluation dataset (every example, once; every
  replica gets a full batch at every step, padding masked)."""
  return strategy.experimental_distribute_dataset(
      eval_dataset(images, labels, global_batch_size))


def distribute_test(strategy, dataset, global_batch_size):
  """`distribute_eval` of a dataset's test split, in memory or from files."""
  if hasattr(dataset, "distribute_eval"):
    return dataset.distribute_eval(strategy, global_batch_size)
  return distribute_eval(strategy, dataset.test_x, dataset.test_y,
                         global_batch_size)
