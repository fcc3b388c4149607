"""TFDS datasets prepared on disk (framework/data/tfds_input.py): read through
FileDataset's shards, per-pipeline sharding and exact resume."""

import os

import numpy as np
import pytest

tfds = pytest.importorskip(
    "tensorflow_datasets",
    reason='tensorflow-datasets is not installed (pip install -e ".[tfds]")')
import tensorflow as tf  # pylint: disable=g-import-not-at-top,wrong-import-order

from framework.data import datasets, file_input  # pylint: disable=g-import-not-at-top
from framework.errors import ConfigError, DataError  # pylint: disable=g-import-not-at-top
from tests.helpers import run_script  # pylint: disable=g-import-not-at-top

NUM_TRAIN, NUM_TEST, NUM_SHARDS, BATCH = 40, 12, 4, 8  # 5 steps per epoch
CLASSES = ("cat", "dog", "fox")


def _images(n, seed):
  rng = np.random.default_rng(seed)
  return (rng.integers(0, 256, (n, 8, 8, 3), dtype=np.uint8),
          rng.integers(0, 3, n))


class MyTiny(tfds.core.GeneratorBasedBuilder):
  """8x8x3 images from numpy, 3 classes; nothing downloaded."""
  VERSION = tfds.core.Version("1.0.0")

  def _info(self):
    return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({
        "image": tfds.features.Image(shape=(8, 8, 3)),
        "label": tfds.features.ClassLabel(names=CLASSES),
        "name": tfds.features.Text()}))

  def _split_generators(self, dl_manager):
    del dl_manager
    return {"train": self._generate_examples(NUM_TRAIN, 0),
            "test": self._generate_examples(NUM_TEST, 1)}

  def _generate_examples(self, n, seed):
    images, labels = _images(n, seed)
    for i in range(n):
      yield f"{seed}-{i}", {"image": images[i], "label": int(labels[i]),
                            "name": f"example {i}"}


class MyTinyMasks(tfds.core.GeneratorBasedBuilder):
  """Images of varying size with a one-channel mask (values 0..2)."""
  VERSION = tfds.core.Version("0.1.0")

  def _info(self):
    return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({
        "image": tfds.features.Image(shape=(None, None, 3)),
        "segmentation_mask": tfds.features.Image(shape=(None, None, 1)),
        "label": tfds.features.ClassLabel(num_classes=2)}))

  def _split_generators(self, dl_manager):
    del dl_manager
    return {"train": self._generate_examples(6), "test": self._generate_examples(2)}

  def _generate_examples(self, n):
    for i in range(n):
      side = 6 + 2 * i  # every size differs
      mask = np.zeros((side, side, 1), np.uint8)
      mask[side // 2:] = 1 + i % 2
      yield i, {"image": np.full((side, side, 3), 10 * i, np.uint8),
                "segmentation_mask": mask, "label": i % 2}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  root = tmp_path_factory.mktemp("tfds")
  MyTiny(data_dir=str(root / "data")).download_and_prepare(
      download_dir=str(root / "downloads"),
      download_config=tfds.download.DownloadConfig(
          num_shards=NUM_SHARDS, try_download_gcs=False))
  MyTinyMasks(data_dir=str(root / "data")).download_and_prepare(
      download_dir=str(root / "downloads"),
      download_config=tfds.download.DownloadConfig(try_download_gcs=False))
  return str(root / "data")


def _keys(images, labels):
  images = np.round(np.asarray(images) * 255).astype(np.uint8)
  return [(int(l), im.tobytes()) for im, l in zip(images, np.asarray(labels))]


def _batches(ds, n):
  return [(x.numpy(), y.numpy()) for x, y in ds.take(n)]


def test_loads_counts_shape_and_class_names(data_dir):
  dataset = datasets.load_dataset("tfds:my_tiny", data_dir, image_size=128)
  assert isinstance(dataset, file_input.FileDataset)
  assert (dataset.num_train_examples, dataset.num_test_examples) == (
      NUM_TRAIN, NUM_TEST)
  assert dataset.input_shape == (8, 8, 3) and dataset.label_shape == ()
  assert dataset.class_names == CLASSES
  assert len(dataset.train.counts) == NUM_SHARDS
  images, labels = dataset.test_samples(3)
  assert images.shape == (3, 8, 8, 3) and images.dtype == np.uint8
  assert set(_keys(images / 255.0, labels)) <= set(_keys(
      _images(NUM_TEST, 1)[0] / 255.0, _images(NUM_TEST, 1)[1]))
  # A version pattern picks the prepared version.
  assert datasets.load_dataset("tfds:my_tiny:1.*.*",
                               data_dir).num_train_examples == NUM_TRAIN


def test_one_epoch_yields_every_train_example_once(data_dir):
  dataset = datasets.load_dataset("tfds:my_tiny", data_dir)
  steps = NUM_TRAIN // BATCH
  batches = _batches(dataset.train_dataset(BATCH, seed=2), 2 * steps)
  expected = sorted(_keys(_images(NUM_TRAIN, 0)[0] / 255.0,
                          _images(NUM_TRAIN, 0)[1]))
  for epoch in range(2):
    got = sorted(k for b in batches[epoch * steps:(epoch + 1) * steps]
                 for k in _keys(*b))
    assert got == expected
  # Evaluation sees every test example once, the last batch partial.
  got = sorted(k for b in _batches(dataset.eval_dataset(5, pad=False), 10)
               for k in _keys(*b))
  assert got == sorted(_keys(_images(NUM_TEST, 1)[0] / 255.0,
                             _images(NUM_TEST, 1)[1]))


def test_resume_gives_the_remaining_batches_exactly(data_dir):
  dataset = datasets.load_dataset("tfds:my_tiny", data_dir)
  whole = _batches(dataset.train_dataset(BATCH, seed=5), 12)
  for start in (3, 7):  # mid first epoch, mid second
    tail = _batches(dataset.train_dataset(BATCH, seed=5, start_step=start),
                    12 - start)
    for (x, y), (wx, wy) in zip(tail, whole[start:]):
      np.testing.assert_array_equal(x, wx)
      np.testing.assert_array_equal(y, wy)


def _pipeline_records(dataset, pipelines, pipeline, steps):
  """The indices the records a pipeline reads carry, by counting reads."""
  seen = []
  read = dataset.train.read

  def counting_read(ids):
    return read(ids).map(lambda r: (tf.numpy_function(
        lambda i: seen.append(int(i)) or i, [r["index"]], tf.int64), r)[1])

  split = file_input.ShardedSplit(dataset.train.counts, counting_read,
                                  dataset.train.decode)
  counted = file_input.FileDataset(
      dataset.name, split, dataset.test, class_names=dataset.class_names,
      image_shape=dataset.input_shape)
  fn = counted.train_dataset_fn(BATCH, seed=1)
  context = tf.distribute.InputContext(pipelines, pipeline, pipelines)
  list(fn(context).take(steps))
  return seen


def test_two_pipelines_read_disjoint_halves_of_the_shards(data_dir):
  dataset = datasets.load_dataset("tfds:my_tiny", data_dir)
  steps = NUM_TRAIN // BATCH  # an epoch: each pipeline reads half
  starts = np.cumsum((0,) + dataset.train.counts)
  shard_of = lambda i: int(np.searchsorted(starts, i, side="right") - 1)
  read = [_pipeline_records(dataset, 2, p, steps) for p in range(2)]
  shards = [{shard_of(i) for i in r} for r in read]
  assert shards == [{0, 2}, {1, 3}]
  assert sorted(read[0] + read[1]) == list(range(NUM_TRAIN))


def test_a_mask_feature_gives_segmentation_resized_to_image_size(data_dir):
  dataset = datasets.load_dataset(
      "tfds:my_tiny_masks", data_dir, image_size=4,
      label_key="segmentation_mask", mask_classes=["bg", "a", "b"])
  assert dataset.input_shape == (4, 4, 3) and dataset.label_shape == (4, 4)
  assert dataset.class_names == ("bg", "a", "b")
  (x, y), = _batches(dataset.eval_dataset(2, pad=False), 1)
  assert x.shape == (2, 4, 4, 3) and y.shape == (2, 4, 4)
  # Example i (TFDS orders a split by key hash): pixels 10*i, lower half of
  # the mask 1 + i % 2.
  seen = set()
  for image, mask in zip(x, y):
    i = int(round(image[0, 0, 0] * 255 / 10))
    seen.add(i)
    np.testing.assert_allclose(image, 10 * i / 255.0, atol=1e-6)
    np.testing.assert_array_equal(mask[:2], 0)
    np.testing.assert_array_equal(mask[2:], 1 + i % 2)
  assert seen == {0, 1}
  with pytest.raises(ConfigError, match="is a mask: give mask_classes"):
    datasets.load_dataset("tfds:my_tiny_masks", data_dir,
                          label_key="segmentation_mask", image_size=4)


def test_not_prepared_and_bad_keys_are_one_line_errors(data_dir, tmp_path):
  with pytest.raises(DataError, match="not prepared.*never downloads"):
    datasets.load_dataset("tfds:my_tiny", str(tmp_path))
  with pytest.raises(DataError, match="versions 1.0.0"):
    datasets.load_dataset("tfds:my_tiny:2.0.0", data_dir)
  with pytest.raises(ConfigError, match="label_key='mask'.*image, label"):
    datasets.load_dataset("tfds:my_tiny", data_dir, label_key="mask")
  with pytest.raises(DataError, match="'name'.*ClassLabel"):
    datasets.load_dataset("tfds:my_tiny", data_dir, label_key="name")
  with pytest.raises(ConfigError, match="tfds:NAME"):
    datasets.load_dataset("tfds:My Tiny", data_dir)


def test_without_tfds_the_error_names_the_extra(data_dir, monkeypatch):
  import sys  # pylint: disable=g-import-not-at-top
  monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)
  with pytest.raises(ConfigError, match=r'pip install -e "\.\[tfds\]"'):
    datasets.load_dataset("tfds:my_tiny", data_dir)


@pytest.mark.slow
def test_train_py_trains_on_a_prepared_tfds_dataset(data_dir, tmp_path):
  model_dir = tmp_path / "run"
  proc = run_script(
      "train.py", "--model=mlp", "--hidden_units=16", "--dataset=tfds:my_tiny",
      f"--data_dir={data_dir}", "--strategy=mirrored", "--cpu_devices=2",
      f"--global_batch_size={BATCH}", "--train_steps=6", "--steps_per_loop=3",
      "--eval_every=3", "--export_saved_model=false",
      f"--model_dir={model_dir}")
  assert f"examples={NUM_TEST}" in proc.stderr
  assert os.path.isfile(model_dir / "checkpoint")


@pytest.mark.slow
def test_train_py_on_an_unprepared_dataset_is_one_line(tmp_path):
  model_dir = tmp_path / "run"
  proc = run_script("train.py", "--model=mlp", "--dataset=tfds:my_tiny:9.*.*",
                    f"--data_dir={tmp_path}", f"--model_dir={model_dir}",
                    "--train_steps=2", check=False)
  assert proc.returncode == 1
  lines = [l for l in proc.stderr.splitlines()
           if l.startswith("train.py: error:")]
  assert len(lines) == 1 and "is not prepared" in lines[0], proc.stderr[-2000:]
  assert not model_dir.exists()
