"""keras-io's "Simple MNIST convnet", ported: its model as a builder, its
data as an array file (`--dataset=numpy`).

    python scripts/examples/mnist_convnet.py --write_data=mnist.npz
    python scripts/train.py --dataset=numpy --data_dir=mnist.npz \
        --model=mnist_convnet:build --strategy=mirrored --cpu_devices=2 \
        --global_batch_size=128 --optimizer=adam --learning_rate=1e-3 \
        --train_steps=500 --model_dir=/tmp/mnist

(run the second command from scripts/examples, or with it on PYTHONPATH;
this file also runs as train.py does, with `--model=mnist_convnet:build
--dataset=numpy` as defaults). `--write_data` saves keras.datasets.mnist
(downloaded by Keras) as uint8 [N, 28, 28, 1] arrays, or with
`--synthetic_digits` generated arrays of the same shape and dtype. The
input pipeline divides uint8 by 255 (keras-io divides by 255 itself), so
the model starts at the first convolution.
"""

import os
import sys

import numpy as np


def build(input_shape, num_classes):
  """keras-io's convnet; logits (no softmax), inputs already in [0, 1]."""
  import keras  # pylint: disable=g-import-not-at-top
  return keras.Sequential([
      keras.Input(shape=input_shape),
      keras.layers.Conv2D(32, kernel_size=(3, 3), activation="relu"),
      keras.layers.MaxPooling2D(pool_size=(2, 2)),
      keras.layers.Conv2D(64, kernel_size=(3, 3), activation="relu"),
      keras.layers.MaxPooling2D(pool_size=(2, 2)),
      keras.layers.Flatten(),
      keras.layers.Dropout(0.5),
      keras.layers.Dense(num_classes),
  ], name="mnist_convnet")


# The generated digits are one data set: the same arrays in every program.
DIGITS_SEED = 0
# --synthetic_examples' default (here and in vae.py).
SYNTHETIC_EXAMPLES = 2048


def build_student(input_shape, num_classes):
  """keras-io distillation's student: a smaller convnet; logits."""
  import keras  # pylint: disable=g-import-not-at-top
  return keras.Sequential([
      keras.Input(shape=input_shape),
      keras.layers.Conv2D(16, (3, 3), strides=(2, 2), padding="same"),
      keras.layers.LeakyReLU(negative_slope=0.2),
      keras.layers.MaxPooling2D(pool_size=(2, 2), strides=(1, 1),
                                padding="same"),
      keras.layers.Conv2D(32, (3, 3), strides=(2, 2), padding="same"),
      keras.layers.Flatten(),
      keras.layers.Dense(num_classes),
  ], name="student")


def synthetic_digits(num_train, seed=DIGITS_SEED):
  """uint8 [N, 28, 28, 1] images and int labels: each class a faint 8x8
  patch (noise + 48) at its own place over noise: learnable, not at once;
  MNIST's shape and dtype."""
  rng = np.random.default_rng(seed)

  def split(n):
    y = rng.integers(0, 10, n)
    x = rng.integers(0, 200, (n, 28, 28, 1))
    for i, label in enumerate(y):
      row, col = 2 + 8 * (label // 4), 2 + 6 * (label % 4)
      x[i, row:row + 8, col:col + 8] += 48
    return np.minimum(x, 255).astype(np.uint8), y.astype(np.int64)

  return split(num_train), split(num_train // 4)


def write_data(path, synthetic, num_train):
  """Saves MNIST (or `synthetic_digits`) to `path` as uint8 arrays."""
  if synthetic:
    (x_train, y_train), (x_test, y_test) = synthetic_digits(num_train)
  else:
    import keras  # pylint: disable=g-import-not-at-top
    (x_train, y_train), (x_test, y_test) = keras.datasets.mnist.load_data()
    x_train, x_test = x_train[..., None], x_test[..., None]
  np.savez(path, x_train=x_train, y_train=y_train, x_test=x_test,
           y_test=y_test, class_names=np.array([str(i) for i in range(10)]))
  print(f"wrote {path}: x_train {x_train.shape} {x_train.dtype}, "
        f"x_test {x_test.shape}")


def _run():
  """train.py with this file's defaults (flags defined only here: the
  module is imported again as `mnist_convnet` for its `build`)."""
  # The installed package only (`pip install -e .`): a copy of this file
  # runs from any folder.
  from distloop_cli import cli  # pylint: disable=g-import-not-at-top
  cli.quiet_startup()  # Before TensorFlow is imported: quiet logs.
  from absl import flags  # pylint: disable=g-import-not-at-top
  from distloop_cli import train  # pylint: disable=g-import-not-at-top
  flags.DEFINE_string("write_data", None, "Write MNIST (or with "
                      "--synthetic_digits generated digits) to this .npz "
                      "and exit.")
  flags.DEFINE_bool("synthetic_digits", False, "--write_data: generated "
                    "arrays of MNIST's shape and dtype (no download).")
  flags.DEFINE_integer("synthetic_examples", SYNTHETIC_EXAMPLES,
                       "--synthetic_digits: "
                       "training examples (a quarter as many test ones).")
  FLAGS = flags.FLAGS  # pylint: disable=invalid-name
  FLAGS.set_default("model", "mnist_convnet:build")
  FLAGS.set_default("dataset", "numpy")

  def main(argv):
    del argv
    if FLAGS.write_data:
      write_data(FLAGS.write_data, FLAGS.synthetic_digits,
                 FLAGS.synthetic_examples)
      return
    train.run_main()

  cli.run_app(main)


if __name__ == "__main__":
  # This folder on sys.path: --model=mnist_convnet:build imports this file.
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  _run()
