"""Evaluation never gives a model an empty batch: every replica's last batch
is padded to its full size and the padding is masked out of every sum.

The eval set has 17 examples and a global batch of 8 on 2 replicas (4 each):
the last global batch holds 1 example, so without padding replica 1 gets 0
rows, from arrays (a split batch) as from files (an odd number of
per-replica batches). The model's first layer raises on a batch of 0 rows,
so this fails on every host, whatever its kernels do with empty tensors.
"""

import re

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

import keras

import framework
import framework.data.datasets  # noqa: F401  (the attribute chain below)
from framework.core.controller import Controller, LoopConfig
from framework.data import file_input, image_folder, inputs, tfrecords
from framework.tasks.segmentation import ConfusionTrainer
from tests.helpers import run_script
from tests.shared_strategy import mirrored

NUM_TEST, BATCH, CLASSES = 17, 8, 3  # 17 = 2 * 8 + 1: replica 1 gets 0 rows


class NonEmpty(keras.layers.Layer):
  """Passes its input through; raises on a batch of 0 rows."""

  def call(self, x):
    tf.debugging.assert_positive(
        tf.shape(x)[0], message="an empty batch reached the model")
    return x


@pytest.fixture(scope="module")
def data():
  return framework.data.datasets.synthetic(num_train=32, num_test=NUM_TEST,
                             image_shape=(4, 4, 3), num_classes=CLASSES,
                             seed=4)


def _model(strategy):
  keras.utils.set_random_seed(1)
  with strategy.scope():
    model = keras.Sequential([keras.Input((4, 4, 3)), NonEmpty(),
                              keras.layers.Flatten(),
                              keras.layers.Dense(CLASSES)])
  return model


def _expected(model, data):
  """Loss, accuracy and confusion of one single-device pass, in numpy."""
  logits = np.asarray(model(data.test_x.astype(np.float32) / 255.0),
                      np.float64)
  log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  y = data.test_y
  confusion = np.zeros((CLASSES, CLASSES))
  np.add.at(confusion, (y, logits.argmax(-1)), 1)
  return (-log_probs[np.arange(len(y)), y].mean(),
          (logits.argmax(-1) == y).mean(), confusion)


def _check(results, confusion, model, data):
  loss, accuracy, want = _expected(model, data)
  assert results["examples"] == NUM_TEST
  assert results["loss"] == pytest.approx(loss, rel=1e-5)
  assert results["accuracy"] == pytest.approx(accuracy)
  np.testing.assert_array_equal(confusion, want)


def _tfrecords(data, path):
  for split, x, y in (("train", data.train_x, data.train_y),
                      ("test", data.test_x, data.test_y)):
    tfrecords.write_split(str(path), split, lambda i, x=x, y=y: (x[i], y[i]),
                          len(x), num_shards=2, class_names=data.class_names,
                          name="synthetic")
  return file_input.load_tfrecord(str(path))


def _image_folder(data, path):
  for split, x, y in (("train", data.train_x, data.train_y),
                      ("test", data.test_x, data.test_y)):
    for i, (image, label) in enumerate(zip(x, y)):
      folder = path / split / f"class_{label}"
      folder.mkdir(parents=True, exist_ok=True)
      Image.fromarray(image).save(folder / f"{i:03d}.png")
  return image_folder.load_image_folder(str(path), files_per_shard=5)


@pytest.mark.parametrize("source", ["arrays", "tfrecord", "image_folder"])
def test_no_replica_gets_an_empty_batch(data, tmp_path, source):
  strategy = mirrored()
  dataset = {"arrays": lambda: data,
             "tfrecord": lambda: _tfrecords(data, tmp_path),
             "image_folder": lambda: _image_folder(data, tmp_path)}[source]()
  model = _model(strategy)
  with strategy.scope():
    optimizer = keras.optimizers.SGD()
  trainer = ConfusionTrainer(model, optimizer, strategy,
                             global_batch_size=BATCH)
  results = trainer.evaluate(inputs.distribute_test(strategy, dataset, BATCH))
  _check(results, trainer.last_confusion, model, data)


class RowCounting(framework.Trainer):
  """An eval_sums override without `mask` (as written before masks)."""

  def eval_sums(self, labels, logits):
    sums = super().eval_sums(labels, logits)
    sums["rows"] = tf.cast(tf.shape(labels)[0], tf.float32)
    return sums


def _controller(data, model_dir, trainer_cls):
  strategy = mirrored()
  model = _model(strategy)
  with strategy.scope():
    optimizer = keras.optimizers.SGD(0.1)
  trainer = trainer_cls(model, optimizer, strategy, global_batch_size=BATCH)
  train = tf.data.Dataset.from_tensor_slices(
      (data.train_x.astype(np.float32) / 255.0, data.train_y))
  test = tf.data.Dataset.from_tensor_slices(
      (data.test_x.astype(np.float32) / 255.0, data.test_y))
  return Controller(
      trainer, LoopConfig(train_steps=2, steps_per_loop=2, checkpoint_every=2,
                          log_every=0, summary_every=0), str(model_dir),
      train_input=lambda step: train.repeat().batch(
          BATCH, drop_remainder=True).skip(step),
      # The user's own batches: the last one holds 1 example.
      eval_input=lambda: test.batch(BATCH))


def _eval_steps(model_dir):
  from tensorboard.backend.event_processing import event_accumulator  # pylint: disable=g-import-not-at-top
  acc = event_accumulator.EventAccumulator(str(model_dir / "eval"))
  acc.Reload()
  return [e.step for e in acc.Tensors("loss")]


def test_a_user_eval_input_is_padded_and_a_fresh_controller_restores(
    data, tmp_path):
  trained = _controller(data, tmp_path, ConfusionTrainer)
  results = trained.run()
  _check(results, trained.trainer.last_confusion, trained.trainer.model, data)
  # A fresh Controller evaluates the run's checkpoint, not its own initial
  # weights, at the run's step; an eval_sums without `mask` sees the real
  # rows only.
  fresh = _controller(data, tmp_path, RowCounting)
  again = fresh.evaluate()
  assert fresh.step == 2
  assert again["loss"] == pytest.approx(results["loss"], rel=1e-6)
  assert again["examples"] == again["rows"] * NUM_TEST == NUM_TEST
  assert _eval_steps(tmp_path) == [2, 2]
  # Nothing to restore: the weights it holds, at its step 0 (Orbit's).
  empty = _controller(data, tmp_path / "empty", ConfusionTrainer)
  assert empty.evaluate()["examples"] == NUM_TEST
  assert _eval_steps(tmp_path / "empty") == [0]


@pytest.mark.slow
def test_train_py_on_tfrecords_whose_last_step_leaves_a_replica_empty(
    tmp_path):
  # As 10,000 CIFAR-10 test examples at --global_batch_size=128 (157
  # per-replica batches of 64, the last one of 16): 33 examples in
  # per-replica batches of 8 are 5 batches, so the last step had a batch
  # for replica 0 only.
  data = framework.data.datasets.synthetic(num_train=64, num_test=33, seed=5)
  source, converted = str(tmp_path / "cifar"), str(tmp_path / "records")
  framework.data.datasets.write_cifar10(source, data.train_x, data.train_y, data.test_x,
                          data.test_y)
  run_script("make_tfrecords.py", "--dataset=cifar10", f"--data_dir={source}",
             f"--output_dir={converted}", "--num_shards=8")
  proc = run_script(
      "train.py", "--model=cifar_cnn", "--dataset=tfrecord",
      f"--data_dir={converted}", "--strategy=mirrored", "--cpu_devices=2",
      "--global_batch_size=16", "--train_steps=2", "--onednn=on",
      "--noexport_saved_model", f"--model_dir={tmp_path / 'run'}")
  assert re.findall(r"eval  step 2: .*examples=(\d+)", proc.stderr) == ["33"]


@pytest.mark.slow
def test_ten_thousand_tfrecord_examples_on_two_replicas_from_another_folder(
    tmp_path):
  # The reported case at its real size: 10,000 test examples in 8 shards,
  # --global_batch_size=128 on 2 replicas (157 per-replica batches of 64,
  # the last one of 16, so the last step had nothing for replica 1), with
  # relative paths from a folder that is not the repository.
  from framework.data.datasets import synthetic, write_cifar10
  data = synthetic(num_train=256, num_test=10_000, seed=7)
  write_cifar10(str(tmp_path / "cifar"), data.train_x, data.train_y,
                data.test_x, data.test_y)
  run_script("make_tfrecords.py", "--dataset=cifar10", "--data_dir=cifar",
             "--output_dir=records", "--num_shards=8", cwd=tmp_path)
  proc = run_script(
      "train.py", "--model=cifar_cnn", "--dataset=tfrecord",
      "--data_dir=records", "--strategy=mirrored", "--cpu_devices=2",
      "--global_batch_size=128", "--train_steps=2", "--onednn=on",
      "--noexport_saved_model", "--model_dir=runs/tfr", cwd=tmp_path,
      timeout=600)
  assert re.findall(r"eval  step 2: .*examples=(\d+)",
                    proc.stderr) == ["10000"], proc.stderr[-3000:]
