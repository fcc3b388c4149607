"""Streaming input from TFRecord shards (framework/data/file_input.py): the same
examples as the arrays, exact resume, per-pipeline file sharding, evaluation
over several pipelines."""

import logging
import re

import numpy as np
import pytest
import tensorflow as tf

import framework
import framework.data.datasets  # noqa: F401  (the attribute chain below)
from framework.data import file_input, inputs, tfrecords
from framework.data import preprocessing
from tests.helpers import run_script

NUM_TRAIN, NUM_TEST, BATCH = 240, 50, 16  # 15 steps per epoch


@pytest.fixture(scope="module")
def data():
  return framework.data.datasets.synthetic(num_train=NUM_TRAIN, num_test=NUM_TEST,
                             image_shape=(8, 8, 3), seed=1)


def _write(path, data, num_shards):
  for split, x, y in (("train", data.train_x, data.train_y),
                      ("test", data.test_x, data.test_y)):
    tfrecords.write_split(str(path), split, lambda i, x=x, y=y: (x[i], y[i]),
                          len(x), num_shards=num_shards,
                          class_names=data.class_names, name="synthetic")
  return str(path)


@pytest.fixture(scope="module")
def files(data, tmp_path_factory):
  return _write(tmp_path_factory.mktemp("six"), data, 6)


def _keys(images, labels):
  """One hashable key per example (images are float in [0, 1])."""
  images = np.round(np.asarray(images) * 255).astype(np.uint8)
  return [(int(l), im.tobytes()) for im, l in zip(images, np.asarray(labels))]


def _batches(ds, n):
  return [(x.numpy(), y.numpy()) for x, y in ds.take(n)]


def test_each_epoch_has_the_same_examples_as_the_arrays(data, files):
  steps = NUM_TRAIN // BATCH
  from_arrays = _batches(inputs.train_dataset(data, BATCH, seed=3), 2 * steps)
  from_files = _batches(inputs.train_dataset(
      file_input.load_tfrecord(files), BATCH, seed=3), 2 * steps)
  for epoch in range(2):
    part = slice(epoch * steps, (epoch + 1) * steps)
    a = sorted(k for b in from_arrays[part] for k in _keys(*b))
    f = sorted(k for b in from_files[part] for k in _keys(*b))
    assert f == a == sorted(_keys(data.train_x / 255.0, data.train_y))
  # The documented difference: another shuffle, so another order.
  assert not np.array_equal(from_arrays[0][0], from_files[0][0])
  # Epochs differ from each other.
  assert not np.array_equal(from_files[0][0], from_files[steps][0])


@pytest.mark.parametrize("start", [0, 7, 15])
def test_global_shuffle_gives_the_arrays_batches_exactly(data, files, start):
  # file_shuffle=global on one pipeline: the very batches of the in-memory
  # arrays (order and augmentation), also when resumed mid-epoch (7) or at
  # an epoch boundary (15).
  steps = 2 * NUM_TRAIN // BATCH - start
  from_arrays = _batches(inputs.train_dataset(
      data, BATCH, seed=3, start_step=start, augment=preprocessing.crop_flip),
                         steps)
  from_files = _batches(inputs.train_dataset(
      file_input.load_tfrecord(files, shuffle="global"), BATCH, seed=3,
      start_step=start, augment=preprocessing.crop_flip), steps)
  assert len(from_files) == len(from_arrays) == steps
  for a, f in zip(from_arrays, from_files):
    np.testing.assert_array_equal(a[0], f[0])
    np.testing.assert_array_equal(a[1], f[1])


def test_global_shuffle_breaks_key_ties_as_the_arrays_do(tmp_path):
  # 30,000 float32 keys hold ~50 equal pairs; the converter deals examples
  # to shards out of index order, so ties must still fall as in the arrays.
  n = 30000
  big = framework.data.datasets.ArrayDataset(
      "big", np.arange(n, dtype=np.int64).view(np.uint8).reshape(n, 2, 1, 4),
      np.zeros(n, np.int32), np.zeros((1, 2, 1, 4), np.uint8),
      np.zeros(1, np.int32), ("a",))
  tfrecords.write_split(str(tmp_path), "train",
                        lambda i: (big.train_x[i], big.train_y[i]), n,
                        num_shards=3, class_names=("a",), name="big")
  tfrecords.write_split(str(tmp_path), "test",
                        lambda i: (big.test_x[i], big.test_y[i]), 1,
                        num_shards=1, class_names=("a",), name="big")
  for seed in (0, 1):
    keys = tf.random.stateless_uniform([n], seed=[seed, 0]).numpy()
    assert len(np.unique(keys)) < n  # the case this test is about
    [(a, _)] = _batches(inputs.train_dataset(big, n, seed=seed), 1)
    [(f, _)] = _batches(inputs.train_dataset(file_input.load_tfrecord(
        str(tmp_path), shuffle="global"), n, seed=seed), 1)
    np.testing.assert_array_equal(a, f)


def test_global_shuffle_needs_an_example_index(files):
  dataset = file_input.load_tfrecord(files)
  split = file_input.ShardedSplit(dataset.train.counts, dataset.train.read,
                                  dataset.train.decode)
  with pytest.raises(framework.ConfigError, match="file_shuffle=global"):
    file_input.FileDataset("x", split, split, class_names=("a",),
                           image_shape=(8, 8, 3), shuffle="global")


def test_resume_gives_the_remaining_batches_exactly(files):
  dataset = file_input.load_tfrecord(files)
  full = _batches(dataset.train_dataset(BATCH, seed=5,
                                        augment=preprocessing.crop_flip), 40)
  for start in (1, 7, 15, 22):
    resumed = _batches(dataset.train_dataset(
        BATCH, seed=5, start_step=start, augment=preprocessing.crop_flip),
                       40 - start)
    for a, b in zip(full[start:], resumed):
      np.testing.assert_array_equal(a[0], b[0])
      np.testing.assert_array_equal(a[1], b[1])
  other_seed = _batches(dataset.train_dataset(BATCH, seed=6), 1)
  assert not np.array_equal(other_seed[0][0], full[0][0])


def test_resume_opens_only_the_group_holding_its_step(files, monkeypatch):
  dataset = file_input.load_tfrecord(files)
  opened = []  # the shard ids of each group read, in order
  read = dataset.train.read

  def logging_read(ids):
    log = tf.py_function(lambda i: opened.append(list(i.numpy())) or 0,
                         [ids], tf.int32)
    return tf.data.Dataset.from_tensors((ids, log)).flat_map(
        lambda i, _: read(i))

  monkeypatch.setattr(dataset, "train", file_input.ShardedSplit(
      dataset.train.counts, logging_read, dataset.train.decode))
  # 6 shards of 40 in groups of 4 and 2: step 12 of 15 (example 192) is in
  # the second group; the first (160 examples) is never opened.
  next(iter(dataset.train_dataset(BATCH, start_step=12)))
  assert len(opened[0]) == 2
  opened.clear()
  next(iter(dataset.train_dataset(BATCH, start_step=0)))
  assert len(opened[0]) == 4


def _pipeline_examples(dataset, pipelines, pipeline, steps):
  context = tf.distribute.InputContext(num_input_pipelines=pipelines,
                                       input_pipeline_id=pipeline,
                                       num_replicas_in_sync=pipelines)
  fn = dataset.train_dataset_fn(BATCH, seed=0)
  return [k for b in _batches(fn(context), steps) for k in _keys(*b)]


def _shard_keys(path, sidecar, shard):
  parse = tfrecords.parse_fn(sidecar["image_shape"], sidecar["label_shape"])
  rows = [parse(r) for r in tf.data.TFRecordDataset(
      f"{path}/{sidecar['shards'][shard]}")]
  return _keys(np.stack([r[1].numpy() for r in rows]) / 255.0,
               [int(r[2]) for r in rows])


def test_two_pipelines_read_disjoint_halves_of_the_shards(files, caplog):
  dataset = file_input.load_tfrecord(files)
  sidecar = tfrecords.read_sidecar(files, "train")
  per_pipeline = NUM_TRAIN // 2 // (BATCH // 2)  # steps of one epoch
  seen = []
  with caplog.at_level(logging.WARNING):
    for pipeline in range(2):
      got = _pipeline_examples(dataset, 2, pipeline, per_pipeline)
      mine = [k for s in range(pipeline, 6, 2)
              for k in _shard_keys(files, sidecar, s)]
      assert len(got) == NUM_TRAIN // 2 == len(mine)
      assert sorted(got) == sorted(mine)  # its shards, every record once
      seen.append(set(got))
  assert not seen[0] & seen[1]
  assert "data sharding" not in caplog.text


def test_fewer_shards_than_pipelines_fall_back_to_data_sharding(
    data, tmp_path, caplog):
  dataset = file_input.load_tfrecord(_write(tmp_path, data, 1))
  steps = NUM_TRAIN // BATCH
  with caplog.at_level(logging.WARNING):
    halves = [_pipeline_examples(dataset, 2, p, steps) for p in range(2)]
  assert re.search(r"1 shards for 2 input pipelines.*data sharding",
                   caplog.text)
  assert not set(halves[0]) & set(halves[1])
  assert sorted(halves[0] + halves[1]) == sorted(
      _keys(data.train_x / 255.0, data.train_y))


def test_data_sharding_resumes_exactly(data, tmp_path):
  # 1 shard over 2 pipelines: the skip counts the common stream's examples.
  fn_of = lambda start: file_input.load_tfrecord(
      _write(tmp_path, data, 1)).train_dataset_fn(BATCH, seed=5,
                                                  start_step=start)
  for pipeline in range(2):
    context = tf.distribute.InputContext(2, pipeline, 2)
    full = _batches(fn_of(0)(context), 40)
    for start in (7, 15, 22):
      resumed = _batches(fn_of(start)(context), 40 - start)
      for a, b in zip(full[start:], resumed):
        np.testing.assert_array_equal(a[0], b[0])


@pytest.mark.parametrize("num_shards", [6, 1])
def test_evaluation_counts_every_example_once_over_two_pipelines(
    data, tmp_path, num_shards, caplog):
  dataset = file_input.load_tfrecord(_write(tmp_path, data, num_shards))
  fn = dataset.eval_dataset_fn(BATCH)
  seen, batches = [], []
  with caplog.at_level(logging.WARNING):
    for pipeline in range(2):
      context = tf.distribute.InputContext(2, pipeline, 2)
      batches.append(0)
      for (x, y), mask in fn(context):
        real = mask.numpy() > 0
        seen += _keys(x.numpy()[real], y.numpy()[real])
        assert len(y) == BATCH // 2  # padded: full per-replica batches
        batches[-1] += 1
  assert sorted(seen) == sorted(_keys(data.test_x / 255.0, data.test_y))
  # Every pipeline takes as many steps: no replica runs out first.
  assert batches[0] == batches[1] >= -(-NUM_TEST // BATCH)


def test_mirrored_gives_the_global_batches_and_evaluates_all(files):
  dataset = file_input.load_tfrecord(files)
  strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
  expected = _batches(dataset.train_dataset(BATCH, seed=2, start_step=3), 4)
  iterator = iter(inputs.distribute_train(strategy, dataset, BATCH, seed=2,
                                          start_step=3))
  for want in expected:
    parts = strategy.experimental_local_results(next(iterator))
    np.testing.assert_array_equal(np.concatenate([p[0] for p in parts]),
                                  want[0])
  count = 0
  for batch in inputs.distribute_test(strategy, dataset, BATCH):
    masks = strategy.experimental_local_results(batch.mask)
    assert [len(m) for m in masks] == [BATCH // 2] * 2
    count += sum(m.numpy().sum() for m in masks)
  assert count == NUM_TEST


def _digest(proc):
  return re.search(r"final weights sha256=(\w+)", proc.stderr).group(1)


@pytest.mark.slow
def test_train_py_resumes_exactly_from_a_checkpoint(files, tmp_path):
  common = ["--model=mlp", "--hidden_units=16", "--dataset=tfrecord",
            f"--data_dir={files}", "--strategy=mirrored", "--cpu_devices=2",
            f"--global_batch_size={BATCH}", "--augment=crop_flip",
            "--steps_per_loop=4", "--checkpoint_every=4", "--eval_every=0",
            "--export_saved_model=false"]
  whole = run_script("train.py", *common, "--train_steps=24",
                     f"--model_dir={tmp_path / 'whole'}")
  stop = int(np.random.default_rng().integers(5, 20))  # a step mid-epoch
  run_script("train.py", *common, f"--train_steps={stop}",
             f"--model_dir={tmp_path / 'cut'}")
  resumed = run_script("train.py", *common, "--train_steps=24",
                       f"--model_dir={tmp_path / 'cut'}")
  assert f"from step {stop}" in resumed.stderr or str(stop) in resumed.stderr
  assert _digest(resumed) == _digest(whole), f"stopped at {stop}"
  assert f"examples={NUM_TEST}" in whole.stderr
