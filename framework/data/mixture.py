"""`--dataset=mix`: a weighted mixture of registered datasets.

    --dataset=mix --mix=code=text:0.7,prose=text:0.3 \\
        --mix_data_dirs=code:corpus/code,prose:corpus/prose

Each source is a dataset loaded as on its own (`datasets.load_dataset`,
its own data_dir); every source must give examples of the same shapes and
dtypes and the same classes. `tf.data.Dataset.choose_from_datasets` merges
the sources' example streams along a choice stream that is a pure function
of (seed, input pipeline, position):

  blocks: a pipeline's examples go in blocks of `BLOCK` positions; a block
    holds exactly `quota[k]` examples of source k (the weights times
    `BLOCK`, rounded by largest remainder), in the order of a stateless
    permutation seeded by (seed, pipeline, block). So the proportions are
    the weights within 1/BLOCK over every block, not only on average.
  resume at step s: the examples each source gave before s are counted
    from the blocks (whole blocks times the quotas, plus one block's
    prefix), and each source's stream starts there: a relaunch sees the
    batches an uninterrupted run sees, nothing is replayed.
  sources: each is read as its own one-example-per-replica input pipeline
    of the same pipeline count (file sharding by worker for files,
    element sharding for arrays), so sharding is that of a single dataset.

The evaluation split is the sources' test splits one after the other.
"""

import dataclasses
import math

from absl import logging
import numpy as np
import tensorflow as tf

from framework.data import datasets, inputs, preprocessing
from framework.data.config import (MIX, DatasetOptions, InputConfig,
                                   mix_dirs, mix_sources)
from framework.errors import ConfigError, DistloopError, check_positive
from framework.settings import default

# Positions per block of the choice stream (proportions exact to 1/BLOCK).
BLOCK = 4096
_MAX_BLOCKS = 1 << 40
_SALT = 0x6D6978  # "mix": the choice stream's seeds differ from the data's


def quotas(weights, block=BLOCK):
  """Examples of each source per block: `weights` (relative) times `block`,
  rounded by largest remainder (ties to the earlier source)."""
  share = np.asarray(weights, np.float64) / math.fsum(weights) * block
  counts = np.floor(share).astype(np.int64)
  rest = np.argsort(-(share - counts), kind="stable")
  counts[rest[:block - counts.sum()]] += 1
  return counts


@dataclasses.dataclass(frozen=True)
class _Source:
  name: str
  dataset_name: str
  weight: float
  data: object


def _example_spec(data, seed):
  """The element spec of one example of `data`'s training stream."""
  return _examples(data, 1, 0, seed, 0, None).element_spec


def _scaled(data):
  """Whether `data`'s features reach the model divided by 255."""
  return preprocessing.scaled_pixels(data)[0] is not False


def _spec_text(spec):
  return ", ".join(f"{s.dtype.name} {s.shape.as_list()}"
                   for s in tf.nest.flatten(spec))


def _examples(data, num_pipelines, pipeline_id, seed, start, augment):
  """Pipeline `pipeline_id`'s training examples of `data` (one source), from
  its example `start` on: the source's own per-pipeline stream read one
  example per replica."""
  kwargs = dict(seed=seed, start_step=start, augment=augment)
  if hasattr(data, "train_dataset_fn"):  # files, numpy
    fn = data.train_dataset_fn(num_pipelines, **kwargs)
  else:  # in-memory arrays
    fn = inputs.per_replica_train_fn(data, num_pipelines, **kwargs)
  context = tf.distribute.InputContext(
      num_input_pipelines=num_pipelines, input_pipeline_id=pipeline_id,
      num_replicas_in_sync=num_pipelines)
  return fn(context).unbatch()


class MixtureDataset(inputs.ReadPerInputPipeline):
  """Training examples drawn from several datasets in fixed proportions
  (see the module docstring); the interface of a `FileDataset`."""

  def __init__(self, sources, seed):
    self.sources = tuple(sources)
    self.name = MIX
    self.seed = seed
    self._num_pipelines = 1
    self.quotas = quotas([s.weight for s in self.sources])
    empty = [s.name for s, q in zip(self.sources, self.quotas) if q == 0]
    if empty:
      raise ConfigError(
          f"mix: the weight of {', '.join(empty)} is below 1/{BLOCK} of the "
          "total, too small to draw any example; raise it")
    first = self.sources[0].data
    spec = _example_spec(first, seed)
    for s in self.sources[1:]:
      theirs = _example_spec(s.data, seed)
      if theirs != spec:
        raise ConfigError(
            f"mix: source {s.name} ({s.dataset_name}) gives examples "
            f"{_spec_text(theirs)}, but {self.sources[0].name} "
            f"({self.sources[0].dataset_name}) gives {_spec_text(spec)}; "
            "every source must give the same shapes and dtypes")
      if _scaled(s.data) != _scaled(first):
        # Both are float32 by now, but on different scales: the mix would
        # train on them as if they were one.
        raise ConfigError(
            f"mix: source {s.name} has {s.data.feature_dtype} features, "
            f"{self.sources[0].name} {first.feature_dtype}; uint8 images are "
            "divided by 255 and other dtypes are not, so every source must "
            "store uint8 or every source another dtype")
      if tuple(s.data.class_names) != tuple(first.class_names):
        raise ConfigError(
            f"mix: source {s.name} has {s.data.num_classes} classes, "
            f"{self.sources[0].name} {first.num_classes}; every source must "
            "have the same classes")
    self.class_names = tuple(first.class_names)
    self.input_shape = tuple(first.input_shape)
    self.label_shape = tuple(getattr(first, "label_shape", ()))
    self.feature_dtype = first.feature_dtype
    self.task = getattr(first, "task", None)
    generations = [f"{s.name}:{s.data.generation}" for s in self.sources
                   if getattr(s.data, "generation", None)]
    self.generation = ",".join(generations) or None
    # What a resume must agree on (a run's run_config "mix"): other shares
    # or sources would start each source's stream elsewhere.
    self.mix_shares = {s.name: f"{s.dataset_name}:{int(q)}/{BLOCK}"
                       for s, q in zip(self.sources, self.quotas)}
    self._owners = tf.constant(np.repeat(np.arange(len(self.sources)),
                                         self.quotas), tf.int64)

  @property
  def num_classes(self):
    return len(self.class_names)

  @property
  def num_train_examples(self):
    return sum(s.data.num_train_examples for s in self.sources)

  @property
  def num_test_examples(self):
    return sum(s.data.num_test_examples for s in self.sources)

  def test_samples(self, n):
    """The first `n` test examples of the first source."""
    return self.sources[0].data.test_samples(n)

  # The choice stream.

  def _block_choices(self, pipeline_id, block):
    """int64 [BLOCK]: the source of each position of one block."""
    # int32 data: fold_in derives other keys from int64 data, and `block`
    # is an int64 tensor in the stream but a Python int in `counts`.
    key = tf.random.experimental.stateless_fold_in(
        tf.constant([self.seed, _SALT], tf.int64),
        tf.constant(pipeline_id, tf.int32))
    key = tf.random.experimental.stateless_fold_in(key,
                                                   tf.cast(block, tf.int32))
    order = tf.argsort(tf.random.stateless_uniform([BLOCK], seed=key))
    return tf.gather(self._owners, order)

  def counts(self, pipeline_id, position):
    """Examples of each source (numpy int64 [sources]) among pipeline
    `pipeline_id`'s first `position` examples."""
    blocks, rest = divmod(int(position), BLOCK)
    with tf.init_scope():  # plain numbers, also inside a traced function
      part = tf.math.bincount(
          tf.cast(self._block_choices(pipeline_id, blocks)[:rest], tf.int32),
          minlength=len(self.sources), dtype=tf.int64).numpy()
    return blocks * self.quotas + part

  def proportions_text(self, counts):
    """`code 700 (70.0%, weight 70.0%), ...` of `counts`."""
    total = max(int(np.sum(counts)), 1)
    weights = np.array([s.weight for s in self.sources])
    weights = weights / weights.sum()
    return ", ".join(
        f"{s.name} {int(c)} ({100 * c / total:.1f}%, weight "
        f"{100 * w:.1f}%)" for s, c, w in zip(self.sources, counts, weights))

  def _choices(self, pipeline_id, position):
    first, offset = divmod(position, BLOCK)
    return tf.data.Dataset.range(first, _MAX_BLOCKS).map(
        lambda b: self._block_choices(pipeline_id, b)).unbatch().skip(offset)

  # Training.

  def _pipeline(self, num_pipelines, pipeline_id, pipeline_batch, batch_size,
                seed, start_step, augment):
    """Batches of `batch_size` of one pipeline that takes `pipeline_batch`
    examples per global step, from step `start_step` on."""
    position = start_step * pipeline_batch
    starts = self.counts(pipeline_id, position)
    if position:
      logging.info("mix: input pipeline %d/%d resumes at step %d after %s",
                   pipeline_id, num_pipelines, start_step,
                   self.proportions_text(starts))
    streams = [_examples(s.data, num_pipelines, pipeline_id, seed, int(n),
                         augment) for s, n in zip(self.sources, starts)]
    ds = tf.data.Dataset.choose_from_datasets(
        streams, self._choices(pipeline_id, position))
    ds = ds.batch(batch_size, drop_remainder=True)
    options = tf.data.Options()
    options.deterministic = True
    # Each source shards itself per pipeline; tf.data shards nothing again.
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.OFF)
    return ds.prefetch(tf.data.AUTOTUNE).with_options(options)

  def train_dataset(self, global_batch_size, *,
                    seed=default(InputConfig, "seed"), start_step=0,
                    augment=None):
    """Endless global batches from step `start_step` on (one pipeline)."""
    check_positive("global_batch_size", global_batch_size)
    return self._pipeline(1, 0, global_batch_size, global_batch_size, seed,
                          start_step, augment)

  def train_dataset_fn(self, global_batch_size, *,
                       seed=default(InputConfig, "seed"), start_step=0,
                       augment=None):
    """A `distribute_datasets_from_function` argument (per-replica batches
    of each pipeline's own mixed stream)."""
    check_positive("global_batch_size", global_batch_size)

    def dataset_fn(context):
      pipelines = context.num_input_pipelines
      self._num_pipelines = pipelines  # what `log_counts` adds up
      return self._pipeline(
          pipelines, context.input_pipeline_id,
          global_batch_size // pipelines,
          context.get_per_replica_batch_size(global_batch_size), seed,
          start_step, augment)

    return dataset_fn

  def log_counts(self, step, global_batch_size, num_pipelines=None):
    """Logs the examples each source gave in the first `step` steps (over
    `num_pipelines` input pipelines; None: as many as last built)."""
    num_pipelines = num_pipelines or self._num_pipelines
    counts = sum(self.counts(p, step * (global_batch_size // num_pipelines))
                 for p in range(num_pipelines))
    logging.info("mix: %d steps drew %s", step,
                 self.proportions_text(counts))
    return counts

  # Evaluation: every source's test split, one after the other.

  def eval_dataset(self, global_batch_size, *, pad=True):
    """One pass over the sources' test splits in order; padded
    `MaskedBatch`es (`pad=False`: plain batches, the last one partial)."""
    check_positive("global_batch_size", global_batch_size)
    parts = []
    for s in self.sources:
      if hasattr(s.data, "eval_dataset"):
        part = s.data.eval_dataset(global_batch_size, pad=False)
      else:
        part = inputs.eval_dataset(s.data.test_x, s.data.test_y,
                                   global_batch_size, pad=False)
      parts.append(part.unbatch())
    ds = parts[0]
    for part in parts[1:]:
      ds = ds.concatenate(part)
    ds = ds.batch(global_batch_size)
    if pad:
      ds = inputs.pad_batches(ds, global_batch_size)
    return ds.prefetch(tf.data.AUTOTUNE).with_options(
        inputs.element_sharded_options())

  def distribute_eval(self, strategy, global_batch_size):
    return strategy.experimental_distribute_dataset(
        self.eval_dataset(global_batch_size))


def load_mix(mix=default(DatasetOptions, "mix"),
             mix_data_dirs=default(DatasetOptions, "mix_data_dirs"),
             seed=default(InputConfig, "seed"), **options):
  """The `MixtureDataset` of `mix` ([LABEL=]DATASET:WEIGHT entries) with
  `mix_data_dirs` (NAME:DIR entries); `options` go to every source's
  loader."""
  entries = mix_sources(mix)
  if not entries:
    raise ConfigError("dataset=mix needs --mix=[LABEL=]DATASET:WEIGHT,... "
                      "(e.g. code=text:0.7,prose=text:0.3)")
  dirs = mix_dirs(mix_data_dirs, [e.name for e in entries])
  sources = []
  for entry in entries:
    try:
      data = datasets.load_dataset(entry.dataset, dirs.get(entry.name),
                                   seed=seed, **options)
    except DistloopError as e:
      raise type(e)(f"mix source {entry.name}={entry.dataset}: {e}") from None
    sources.append(_Source(entry.name, entry.dataset, entry.weight, data))
  return MixtureDataset(sources, seed)


def _register():
  def load(data_dir=None, seed=default(InputConfig, "seed"), **options):
    del data_dir  # each source has its own (mix_data_dirs)
    return load_mix(seed=seed, **options)

  datasets.DATASETS[MIX] = load


_register()
