"""keras-io's "Variational AutoEncoder", ported: the encoder is the run's
model, the decoder a second model the trainer tracks, one optimizer, the
loss a `compute_loss` on unlabeled images.

    python scripts/examples/vae.py --write_data=digits.npz
    python scripts/examples/vae.py --data_dir=digits.npz \
        --strategy=mirrored --cpu_devices=2 --global_batch_size=128 \
        --optimizer=adam --learning_rate=1e-3 --train_steps=500 \
        --model_dir=/tmp/vae

This file runs as train.py does, with `--model=vae:build --dataset=numpy`
as defaults (every train.py flag works; `--model_options=latent_dim=N`
sizes the latent space, 2 by default as keras-io's). `--write_data` saves
`mnist_convnet.synthetic_digits`' images without their labels (an .npz
with `x_train` and `x_test` only: unlabeled data, each batch the images
alone), or with `--mnist` keras.datasets.mnist's (downloaded by Keras).

keras-io's `VAE(keras.Model)` overrides `train_step`; here only the loss is
the port's (`VAETrainer.compute_loss`, `task = "custom"`): the default step
trains the encoder and the tracked decoder with the run's optimizer, so
gradient accumulation, clipping and every strategy work unchanged. The
trainer is imported from this module by name (`vae.VAETrainer`), so
`evaluate.py --trust_model_code` finds it. No SavedModel is exported (its
signature serves class probabilities); `model.weights.h5` holds the
encoder.
"""

import os
import sys

if __name__ == "__main__":
  # The installed package only (`pip install -e .`): a copy of this file
  # runs from any folder.
  from distloop_cli import cli  # pylint: disable=g-import-not-at-top
  cli.quiet_startup()  # Before TensorFlow is imported: quiet logs.
  cli.import_tensorflow_quietly()  # This module imports it right away.

import keras  # pylint: disable=g-import-not-at-top
from keras import layers  # pylint: disable=g-import-not-at-top
from keras import ops  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top

import framework  # pylint: disable=g-import-not-at-top


class Sampling(layers.Layer):
  """keras-io's: z = z_mean + exp(z_log_var / 2) * epsilon, epsilon from the
  layer's own SeedGenerator (keras-io's seed, 1337)."""

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.seed_generator = keras.random.SeedGenerator(1337)

  def call(self, inputs):
    z_mean, z_log_var = inputs
    batch = ops.shape(z_mean)[0]
    dim = ops.shape(z_mean)[1]
    epsilon = keras.random.normal(shape=(batch, dim),
                                  seed=self.seed_generator)
    return z_mean + ops.exp(0.5 * z_log_var) * epsilon


def build(input_shape, num_classes, latent_dim=2):
  """keras-io's encoder: images in [0, 1] to [z_mean, z_log_var, z].

  `num_classes` is 0 (unlabeled data) and not used.
  """
  del num_classes
  inputs = keras.Input(shape=input_shape)
  x = layers.Conv2D(32, 3, activation="relu", strides=2,
                    padding="same")(inputs)
  x = layers.Conv2D(64, 3, activation="relu", strides=2, padding="same")(x)
  x = layers.Flatten()(x)
  x = layers.Dense(16, activation="relu")(x)
  z_mean = layers.Dense(latent_dim, name="z_mean")(x)
  z_log_var = layers.Dense(latent_dim, name="z_log_var")(x)
  z = Sampling()([z_mean, z_log_var])
  return keras.Model(inputs, [z_mean, z_log_var, z], name="encoder")


def build_decoder(latent_dim, image_shape):
  """keras-io's decoder: z to an image of `image_shape` (height and width
  divisible by 4) in [0, 1]."""
  height, width, channels = image_shape
  latent_inputs = keras.Input(shape=(latent_dim,))
  x = layers.Dense(height // 4 * width // 4 * 64,
                   activation="relu")(latent_inputs)
  x = layers.Reshape((height // 4, width // 4, 64))(x)
  x = layers.Conv2DTranspose(64, 3, activation="relu", strides=2,
                             padding="same")(x)
  x = layers.Conv2DTranspose(32, 3, activation="relu", strides=2,
                             padding="same")(x)
  outputs = layers.Conv2DTranspose(channels, 3, activation="sigmoid",
                                   padding="same")(x)
  return keras.Model(latent_inputs, outputs, name="decoder")


def vae_losses(images, reconstruction, z_mean, z_log_var):
  """keras-io's two losses, per example: the binary cross-entropy of the
  reconstruction summed over the pixels, and the KL divergence of
  N(z_mean, exp(z_log_var)) from N(0, 1)."""
  reconstruction_loss = ops.sum(
      keras.losses.binary_crossentropy(images, reconstruction), axis=(1, 2))
  kl = -0.5 * (1 + z_log_var - ops.square(z_mean) - ops.exp(z_log_var))
  return reconstruction_loss, ops.sum(kl, axis=1)


class VAETrainer(framework.Trainer):
  """keras-io's VAE step as a `compute_loss`: reconstruction + KL per
  example, on unlabeled batches (the images alone). The decoder is created
  under the strategy's scope and tracked: in every checkpoint, and trained
  by the default step with the run's optimizer.

  Args:
    **kwargs: `framework.Trainer`'s.
  """

  task = "custom"

  def __init__(self, model, optimizer, strategy, **kwargs):
    super().__init__(model, optimizer, strategy, **kwargs)
    with strategy.scope():  # one copy per replica
      self.decoder = build_decoder(model.outputs[0].shape[-1],
                                   tuple(model.input_shape[1:]))
    self.track(decoder=self.decoder)

  def compute_loss(self, batch):
    images = batch  # unlabeled: the images alone
    z_mean, z_log_var, z = self.model(images, training=True)
    reconstruction = self.decoder(z, training=True)
    error, kl = vae_losses(images, reconstruction, z_mean, z_log_var)
    return error + kl, {"reconstruction": error, "kl": kl}


def write_data(path, mnist, num_train):
  """Saves unlabeled images (`x_train`, `x_test` only) to `path`."""
  if mnist:
    (x_train, _), (x_test, _) = keras.datasets.mnist.load_data()
    x_train, x_test = x_train[..., None], x_test[..., None]
  else:
    import mnist_convnet  # pylint: disable=g-import-not-at-top
    (x_train, _), (x_test, _) = mnist_convnet.synthetic_digits(num_train)
  np.savez(path, x_train=x_train, x_test=x_test)
  print(f"wrote {path}: x_train {x_train.shape} {x_train.dtype}, "
        f"x_test {x_test.shape}, no labels")


def _run():
  """train.py with this file's defaults and trainer (flags defined only
  here: the module is imported again as `vae` for its `build` and
  `VAETrainer`)."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  from distloop_cli import train  # pylint: disable=g-import-not-at-top
  import mnist_convnet  # pylint: disable=g-import-not-at-top
  flags.DEFINE_string("write_data", None, "Write unlabeled MNIST-shaped "
                      "digits (mnist_convnet's generated ones, or with "
                      "--mnist MNIST's) to this .npz and exit.")
  flags.DEFINE_bool("mnist", False, "--write_data: keras.datasets.mnist's "
                    "images (downloaded by Keras) instead of generated ones.")
  flags.DEFINE_integer("synthetic_examples",
                       mnist_convnet.SYNTHETIC_EXAMPLES, "--write_data: "
                       "generated training images (a quarter as many test "
                       "ones).")
  FLAGS = flags.FLAGS  # pylint: disable=invalid-name
  FLAGS.set_default("model", "vae:build")
  FLAGS.set_default("dataset", "numpy")

  def main(argv):
    del argv
    if FLAGS.write_data:
      write_data(FLAGS.write_data, FLAGS.mnist, FLAGS.synthetic_examples)
      return
    import vae  # pylint: disable=g-import-not-at-top
    train.run_main(trainer_cls=vae.VAETrainer)

  cli.run_app(main)


if __name__ == "__main__":
  # This folder on sys.path: --model=vae:build and the trainer import this
  # file as the module `vae`.
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  _run()
