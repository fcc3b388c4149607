"""Input-only throughput of a TFRecord directory against what training consumes.

    python scripts/make_tfrecords.py --dataset=cifar10 \
        --data_dir=../shared/data/cifar10/cifar-10-batches-py \
        --output_dir=/tmp/cifar10_tfrecords --num_shards=16
    python scripts/benchmarks/input_pipeline.py --data_dir=/tmp/cifar10_tfrecords

Prints examples/s of (a) the streaming pipeline alone (decode, batch,
augmentation; nothing trains) and (b) training the seed CNN (`cifar_cnn`) on
the same pipeline, in the same process, and their ratio: the pipeline
should deliver several times what training consumes.
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))

from absl import app  # pylint: disable=g-import-not-at-top
from scripts import cli  # pylint: disable=g-import-not-at-top
cli.quiet_startup()
from absl import flags

from framework.app.config import ExperimentConfig  # pylint: disable=g-import-not-at-top
from framework.settings import default  # pylint: disable=g-import-not-at-top

FLAGS = flags.FLAGS
flags.DEFINE_string("data_dir", None, "A directory from make_tfrecords.py.")
flags.DEFINE_integer("global_batch_size",
                     default(ExperimentConfig, "global_batch_size"),
                     "Examples per step.")
flags.DEFINE_integer("input_steps", 300, "Batches timed, input only.")
flags.DEFINE_integer("train_steps", 60, "Steps timed, training.")
flags.DEFINE_enum("augment", "crop_flip", ["none", "flip", "crop_flip"],
                  "Training augmentation (as in the reference recipe).")
flags.mark_flag_as_required("data_dir")


def _rate(fn, steps, batch):
  start = time.perf_counter()
  fn(steps)
  return steps * batch / (time.perf_counter() - start)


def bench():
  # pylint: disable=g-import-not-at-top
  import tensorflow as tf
  import models
  from framework.data import file_input
  from framework.data import preprocessing
  from framework.core.optimizers import OptimizerConfig, make_optimizer
  from framework.core.trainer import Trainer
  # pylint: enable=g-import-not-at-top
  dataset = file_input.load_tfrecord(FLAGS.data_dir)
  batch = FLAGS.global_batch_size
  augment_fn = preprocessing.get_augmentation(FLAGS.augment)
  iterator = iter(dataset.train_dataset(batch, augment=augment_fn))

  def read(n):
    for _ in range(n):
      next(iterator)

  read(20)  # warm-up: tracing, first groups, prefetch
  input_rate = _rate(read, FLAGS.input_steps, batch)

  strategy = tf.distribute.get_strategy()
  model = models.build_model("cifar_cnn", dataset.input_shape,
                             dataset.num_classes)
  trainer = Trainer(model, make_optimizer(OptimizerConfig()), strategy,
                    global_batch_size=batch)
  train_iterator = iter(strategy.experimental_distribute_dataset(
      dataset.train_dataset(batch, augment=augment_fn)))

  def train(n):
    trainer.train(train_iterator, n)

  train(10)  # warm-up: tracing
  train_rate = _rate(lambda n: [train(10) for _ in range(n // 10)],
                     FLAGS.train_steps // 10 * 10, batch)
  print(f"input only: {input_rate:,.0f} examples/s  "
        f"(batch {batch}, augment={FLAGS.augment})")
  print(f"training cifar_cnn: {train_rate:,.0f} examples/s")
  print(f"input / training: {input_rate / train_rate:.1f}x")


main = cli.main_running(bench)

if __name__ == "__main__":
  app.run(main)
