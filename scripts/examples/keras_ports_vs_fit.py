"""A keras-io port against Keras's own `model.fit`, same model, data, steps,
seed and optimizer, on one device and on `mirrored`, back to back.

    python scripts/examples/keras_ports_vs_fit.py --steps=200 --batch=64
    python scripts/examples/keras_ports_vs_fit.py --port=distillation

Ports, on generated MNIST-shaped uint8 arrays
(`mnist_convnet.synthetic_digits`; no download): keras-io's MNIST convnet
(`mnist_convnet.build`), and keras-io's knowledge distillation (its
`Distiller` model's `compute_loss` under `fit` against distillation.py's
`Distiller` trainer) of `mnist_convnet.build_student` from a teacher
(`mnist_convnet.build`) trained first by `fit` for `--teacher_steps`; and
`keras.applications.ResNet50` by name (`--port=resnet50`, the digits padded
to 32x32x3).
Prints one table row per (trainer, strategy): test loss and accuracy after
`--steps`, and the examples/s of the second half of the steps (the first
half includes tracing), with distloop's as a ratio of fit's.
docs/results/keras_ports.md records a run.
"""

import os
import sys
import tempfile
import time

# The installed package only (`pip install -e .`): a copy of this file runs
# from any folder.
from distloop_cli import cli
cli.quiet_startup()

from absl import app, flags  # pylint: disable=g-import-not-at-top

flags.DEFINE_integer("steps", 200, "Training steps of each run.")
flags.DEFINE_integer("batch", 64, "Global batch size.")
flags.DEFINE_integer("examples", 4096, "Generated training examples.")
flags.DEFINE_integer("run_seed", 0, "Seed of both trainers.")
flags.DEFINE_enum("port", "mnist_convnet",
                  ["mnist_convnet", "distillation", "resnet50"], "Which port.")
flags.DEFINE_integer("teacher_steps", 200, "distillation: the teacher's "
                     "training steps (model.fit, one device).")
ALPHA, TEMPERATURE = 0.1, 10.0  # keras-io's
FLAGS = flags.FLAGS


def _data(path):
  import numpy as np  # pylint: disable=g-import-not-at-top
  import mnist_convnet  # pylint: disable=g-import-not-at-top
  (x, y), (x_test, y_test) = mnist_convnet.synthetic_digits(FLAGS.examples)
  if FLAGS.port == "resnet50":  # its smallest input: 32x32x3
    def rgb32(images):
      return np.repeat(np.pad(images, ((0, 0), (2, 2), (2, 2), (0, 0))), 3,
                       axis=-1)
    x, x_test = rgb32(x), rgb32(x_test)
  np.savez(path, x_train=x, y_train=y, x_test=x_test, y_test=y_test)
  return (x, y), (x_test, y_test)


def _distloop(strategy_name, strategy, data_path):
  import framework  # pylint: disable=g-import-not-at-top
  import json  # pylint: disable=g-import-not-at-top
  from framework.app import experiment  # pylint: disable=g-import-not-at-top
  import mnist_convnet  # pylint: disable=g-import-not-at-top
  model_dir = tempfile.mkdtemp()
  half = FLAGS.steps // 2
  config = framework.ExperimentConfig(
      dataset="numpy", data_dir=data_path, model_dir=model_dir,
      strategy=strategy_name, global_batch_size=FLAGS.batch,
      train_steps=FLAGS.steps, seed=FLAGS.run_seed, export_saved_model=False,
      optimizer=framework.OptimizerConfig(name="adam", learning_rate=1e-3),
      loop=framework.LoopConfig(train_steps=FLAGS.steps, steps_per_loop=half))
  if FLAGS.port == "distillation":
    import functools  # pylint: disable=g-import-not-at-top
    import distillation  # pylint: disable=g-import-not-at-top
    results = experiment.run(
        config, strategy=strategy, build_model=mnist_convnet.build_student,
        trainer_cls=functools.partial(
            distillation.Distiller, teacher_model="mnist_convnet:build",
            teacher_weights=TEACHER, alpha=ALPHA,
            distillation_temperature=TEMPERATURE))
  elif FLAGS.port == "resnet50":
    import dataclasses  # pylint: disable=g-import-not-at-top
    results = experiment.run(dataclasses.replace(
        config, model="keras.applications:ResNet50"), strategy=strategy)
  else:
    results = experiment.run(config, strategy=strategy,
                             build_model=mnist_convnet.build)
  speed = None
  with open(os.path.join(model_dir, "metrics.jsonl")) as f:
    for line in f:
      row = json.loads(line)
      if row["split"] == "train" and row["name"] == "examples_per_second":
        speed = row["value"]  # the last loop's: steady state
  return results["loss"], results["accuracy"], speed


def _fit(strategy, train, test):
  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import mnist_convnet  # pylint: disable=g-import-not-at-top
  keras.utils.set_random_seed(FLAGS.run_seed)
  (x, y), (x_test, y_test) = train, test
  cross_entropy = keras.losses.SparseCategoricalCrossentropy(
      from_logits=True)
  with strategy.scope():
    if FLAGS.port == "distillation":
      student = mnist_convnet.build_student((28, 28, 1), 10)
      teacher = mnist_convnet.build((28, 28, 1), 10)
      teacher.load_weights(TEACHER)
      model = _KerasIoDistiller(student, teacher)
      model.compile(optimizer=keras.optimizers.Adam(1e-3),
                    metrics=["accuracy"])
    elif FLAGS.port == "resnet50":
      model = keras.applications.ResNet50(
          weights=None, input_shape=x.shape[1:], classes=10,
          classifier_activation=None)
      model.compile(optimizer=keras.optimizers.Adam(1e-3),
                    loss=cross_entropy, metrics=["accuracy"])
    else:
      model = mnist_convnet.build((28, 28, 1), 10)
      model.compile(optimizer=keras.optimizers.Adam(1e-3),
                    loss=cross_entropy, metrics=["accuracy"])
  data = tf.data.Dataset.from_tensor_slices((x.astype("float32") / 255, y))
  data = data.shuffle(len(x), seed=FLAGS.run_seed).repeat().batch(
      FLAGS.batch, drop_remainder=True)
  half = FLAGS.steps // 2
  times = {}

  class Clock(keras.callbacks.Callback):

    def on_train_batch_end(self, batch, logs=None):
      if batch + 1 in (half, FLAGS.steps):
        times[batch + 1] = time.perf_counter()

  model.fit(data, epochs=1, steps_per_epoch=FLAGS.steps, verbose=0,
            callbacks=[Clock()])
  if FLAGS.port == "distillation":  # the student, on its own loss
    model = model.student
    with strategy.scope():
      model.compile(loss=cross_entropy, metrics=["accuracy"])
  loss, accuracy = model.evaluate(x_test.astype("float32") / 255, y_test,
                                  batch_size=FLAGS.batch, verbose=0)
  speed = (FLAGS.steps - half) * FLAGS.batch / (times[FLAGS.steps]
                                                - times[half])
  return loss, accuracy, speed


TEACHER = None  # the teacher's weights file (distillation)
_KerasIoDistiller = None  # its class, made once TensorFlow is set up


def _keras_io_distiller():
  """keras-io's `Distiller` (Keras 3 version: a `compute_loss` override)."""
  import keras  # pylint: disable=g-import-not-at-top
  from keras import ops  # pylint: disable=g-import-not-at-top

  class Distiller(keras.Model):

    def __init__(self, student, teacher):
      super().__init__()
      self.teacher = teacher
      self.student = student
      self.teacher.trainable = False

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None,
                     allow_empty=False):
      teacher_pred = self.teacher(x, training=False)
      student_loss = keras.losses.SparseCategoricalCrossentropy(
          from_logits=True)(y, y_pred)
      distillation_loss = keras.losses.KLDivergence()(
          ops.softmax(teacher_pred / TEMPERATURE, axis=1),
          ops.softmax(y_pred / TEMPERATURE, axis=1)) * TEMPERATURE ** 2
      return ALPHA * student_loss + (1 - ALPHA) * distillation_loss

    def call(self, x):
      return self.student(x)

  return Distiller


def _train_teacher(train):
  """The teacher's weights file: mnist_convnet.build after `fit`."""
  import keras  # pylint: disable=g-import-not-at-top
  import mnist_convnet  # pylint: disable=g-import-not-at-top
  keras.utils.set_random_seed(FLAGS.run_seed + 1)
  teacher = mnist_convnet.build((28, 28, 1), 10)
  teacher.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True))
  x, y = train
  teacher.fit(x.astype("float32") / 255, y, batch_size=FLAGS.batch,
              epochs=1, steps_per_epoch=FLAGS.teacher_steps, verbose=0)
  path = os.path.join(tempfile.mkdtemp(), "teacher.weights.h5")
  teacher.save_weights(path)
  return path


def main(argv):
  del argv
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import framework  # pylint: disable=g-import-not-at-top
  framework.configure_cpu_devices(2)
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  tf.get_logger().setLevel("ERROR")
  data_path = os.path.join(tempfile.mkdtemp(), "digits.npz")
  train, test = _data(data_path)
  global TEACHER, _KerasIoDistiller  # pylint: disable=global-statement
  if FLAGS.port == "distillation":
    TEACHER = _train_teacher(train)
    _KerasIoDistiller = _keras_io_distiller()
  print(f"| port | strategy | trainer | steps | test loss | test accuracy "
        f"| examples/s | distloop / fit |")
  print("|---|---|---|---|---|---|---|---|")
  for name in ("default", "mirrored"):
    strategy = framework.make_strategy(name)
    fit = _fit(strategy, train, test)
    ours = _distloop(name, strategy, data_path)
    for trainer, (loss, accuracy, speed) in (("model.fit", fit),
                                            ("distloop", ours)):
      ratio = f"{ours[2] / fit[2]:.2f}" if trainer == "distloop" else ""
      print(f"| {FLAGS.port} | {name} | {trainer} | {FLAGS.steps} | "
            f"{loss:.4f} | {accuracy:.4f} | {speed:.0f} | {ratio} |",
            flush=True)


if __name__ == "__main__":
  app.run(main)
