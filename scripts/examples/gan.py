"""A small GAN, after keras-io's "GAN overriding Model.train_step": two
models, two optimizers, two updates per step.

Run it exactly like scripts/train.py (every train.py flag works):

    python scripts/examples/gan.py --model=mlp --dataset=synthetic \
        --strategy=mirrored --cpu_devices=2 --train_steps=50 \
        --model_dir=/tmp/gan

The run's model (`--model`) is the discriminator, and a classifier too: the
semi-supervised GAN of Salimans et al. (2016), whose logits give both the
class and, through logsumexp, "real" (D = sigmoid(logsumexp(logits))), so
evaluation and the export work as for any classifier. The generator and its
optimizer are created in `__init__` under `self.strategy.scope()` and
registered with `self.track(...)`: every checkpoint holds them, and a run
killed with kill -9 resumes exactly as an uninterrupted one. The noise is
stateless, drawn from (step, replica), so a resumed step draws the same.
A resume trains the generator at --generator_learning_rate (logged when it
differs from the checkpoint's), as the discriminator at --learning_rate.
"""

import functools
import math

# The installed package only (`pip install -e .`): a copy of this file runs
# from any folder.
from distloop_cli import cli
cli.quiet_startup()  # Before TensorFlow is imported: train.py's quiet logs.
cli.import_tensorflow_quietly()  # This module imports it right away.

from absl import flags  # pylint: disable=g-import-not-at-top
from absl import logging  # pylint: disable=g-import-not-at-top
import keras
import numpy as np
import tensorflow as tf

import framework
from distloop_cli import train

flags.DEFINE_integer("latent_dim", 32, "Noise dimensions of the generator.")
flags.DEFINE_float("generator_learning_rate", 1e-3, "Adam rate of the "
                   "generator (the discriminator uses --learning_rate).")
FLAGS = flags.FLAGS


def build_generator(latent_dim, image_shape):
  """The generator: noise [latent_dim] to an image of `image_shape` in
  [0, 1] (what the input pipeline hands the discriminator)."""
  return keras.Sequential([
      keras.Input((latent_dim,)),
      keras.layers.Dense(128, activation="relu"),
      keras.layers.Dense(math.prod(image_shape), activation="sigmoid"),
      keras.layers.Reshape(image_shape)], name="generator")


def noise(step, batch_size, latent_dim):
  """This replica's noise [batch_size, latent_dim] of step `step` (the
  steps done before it): stateless, the same again on a resumed step."""
  replica = tf.distribute.get_replica_context().replica_id_in_sync_group
  seed = tf.stack([tf.cast(step, tf.int32), tf.cast(replica, tf.int32)])
  return tf.random.stateless_normal([batch_size, latent_dim], seed=seed)


class GANTrainer(framework.Trainer):
  """Discriminator step (`self.model`, `self.optimizer`: real images
  classified and called real, generated ones called fake), then generator
  step (`self.generator`, `self.generator_optimizer`: make the
  discriminator call its images real).

  Args:
    latent_dim: the generator's noise size.
    generator_learning_rate: its Adam rate.
    **kwargs: `framework.Trainer`'s.
  """

  train_step_handles = ()

  def __init__(self, model, optimizer, strategy, *, latent_dim=32,
               generator_learning_rate=1e-3, **kwargs):
    super().__init__(model, optimizer, strategy, **kwargs)
    self.latent_dim = int(latent_dim)
    with strategy.scope():  # one copy per replica
      self.generator = build_generator(self.latent_dim,
                                       tuple(model.input_shape[1:]))
      self.generator_optimizer = keras.optimizers.Adam(
          generator_learning_rate)
      self.generator_optimizer.build(self.generator.trainable_variables)
    self.track(generator=self.generator,
               generator_optimizer=self.generator_optimizer)
    self.generator_learning_rate = float(generator_learning_rate)
    self._rate_applied = False

  def train(self, iterator, num_steps):
    if not self._rate_applied:
      self._apply_generator_rate()
    return super().train(iterator, num_steps)

  def _apply_generator_rate(self):
    """Sets the generator's rate to `generator_learning_rate` before the
    first step: a resumed run restored the checkpoint's, and, as the
    discriminator's --learning_rate, the flag decides."""
    self._rate_applied = True
    opt = self.generator_optimizer
    restored = float(keras.ops.convert_to_numpy(opt.learning_rate))
    wanted = self.generator_learning_rate
    if restored != float(np.float32(wanted)):
      opt.learning_rate = wanted  # assigned to its (checkpointed) variable
      logging.info("generator_learning_rate=%g replaces the checkpoint's %g",
                   wanted, restored)

  def _noise(self, images):
    return noise(self.global_step, tf.shape(images)[0], self.latent_dim)

  def train_step(self, batch):
    images, labels = batch
    noise = self._noise(images)
    # 1. The discriminator: classify real images, call them real, call the
    #    generated ones fake.
    fake = self.generator(noise, training=True)
    with tf.GradientTape() as tape:
      logits = self.model(images, training=True)
      fake_logits = self.model(fake, training=True)
      real_score = tf.reduce_logsumexp(logits, axis=-1)
      fake_score = tf.reduce_logsumexp(fake_logits, axis=-1)
      classify = self.loss_fn(labels, logits)
      adversarial = tf.nn.softplus(-real_score) + tf.nn.softplus(fake_score)
      d_loss = self.average(classify + adversarial)
    grads = self.all_reduce(tape.gradient(d_loss,
                                          self.model.trainable_variables))
    grads, grad_norm = self.clip_by_global_norm(grads)
    self.apply_gradients(grads)
    # 2. The generator: make the (updated) discriminator call fakes real.
    g_vars = self.generator.trainable_variables
    with tf.GradientTape() as tape:
      fake_score = tf.reduce_logsumexp(
          self.model(self.generator(noise, training=True), training=True),
          axis=-1)
      g_loss = self.average(tf.nn.softplus(-fake_score))
    g_grads = self.all_reduce(tape.gradient(g_loss, g_vars))
    tf.distribute.get_replica_context().merge_call(
        self._apply_generator, args=(g_grads, g_vars))
    return {"loss": self.average(classify), "d_loss": d_loss,
            "g_loss": g_loss,
            "accuracy": self.average(self.correct(labels, logits)),
            "grad_norm": self.replica_share(grad_norm)}

  def _apply_generator(self, strategy, grads, variables):
    """Cross-replica: one Adam step of the generator with the reduced
    gradients, on every copy (as `apply_gradients` for the model)."""
    opt = self.generator_optimizer

    def update(var, grad):
      return opt.update_step(grad, var, tf.cast(opt.learning_rate, var.dtype))

    for grad, var in zip(grads, variables):
      strategy.extended.update(getattr(var, "value", var), update,
                               args=(grad,), group=False)
    opt.iterations.assign_add(1)


def main(argv):
  del argv
  train.run_main(trainer_cls=functools.partial(
      GANTrainer, latent_dim=FLAGS.latent_dim,
      generator_learning_rate=FLAGS.generator_learning_rate))


if __name__ == "__main__":
  cli.run_app(main)
