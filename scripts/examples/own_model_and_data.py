"""Bring your own model, data and train step; distloop runs the loop.

    python scripts/examples/own_model_and_data.py --model_dir=/tmp/own
    tensorboard --logdir /tmp/own

No registry and no project flags: a functional Keras model, a tf.data
pipeline and a Trainer subclass, trained under MirroredStrategy on 2 logical
CPUs by `framework.Controller`, which checkpoints, resumes and writes
TensorBoard summaries of whatever metrics the step returns. The run stops
halfway (as if preempted) and a fresh Controller resumes it from the
checkpoint; running the script again resumes (and finds nothing to do).
"""

# The installed package only (`pip install -e .`): a copy of this file runs
# from any folder, with train.py's quiet logs and one-line errors.
from distloop_cli import cli
cli.quiet_startup()  # Before TensorFlow is imported.

from absl import flags  # pylint: disable=g-import-not-at-top
from absl import logging

import framework  # pylint: disable=g-import-not-at-top

flags.DEFINE_string("model_dir", "/tmp/distloop_own", "Checkpoints and "
                    "TensorBoard.")
flags.DEFINE_integer("train_steps", 60, "Global steps.")
flags.DEFINE_integer("global_batch_size", 64, "Examples per step, both "
                     "replicas together.")
FLAGS = flags.FLAGS


def build_model(keras):
  """Two-moons classifier: a functional model with an L2 regulariser."""
  inputs = keras.Input((2,), name="point")
  x = keras.layers.Dense(32, activation="relu",
                         kernel_regularizer=keras.regularizers.L2(1e-4))(inputs)
  x = keras.layers.Dense(32, activation="relu")(x)
  return keras.Model(inputs, keras.layers.Dense(2, name="logits")(x))


def make_data(tf, np, n, seed):
  """Two interleaved half circles with noise: (points float32, labels)."""
  rng = np.random.default_rng(seed)
  labels = rng.integers(0, 2, n)
  angle = rng.uniform(0, np.pi, n)
  points = np.stack([np.cos(angle) + labels, np.sin(angle) * (1 - 2 * labels)
                     + 0.5 * labels], axis=1)
  points += rng.normal(0, 0.1, points.shape)
  return tf.data.Dataset.from_tensor_slices(
      (points.astype(np.float32), labels.astype(np.int32)))


def make_trainer_class(tf):
  """The train step (defined here because TensorFlow loads in main)."""

  class MarginTrainer(framework.Trainer):
    """Cross-entropy plus a hinge on the logit margin; reports the error
    rate and the mean margin instead of accuracy."""

    def train_step(self, batch):
      points, labels = batch
      with tf.GradientTape() as tape:
        logits = self.model(points, training=True)
        per_example = self.loss_fn(labels, logits)  # per-example loss
        true = tf.gather(logits, labels, batch_dims=1)
        margin = true - tf.gather(logits, 1 - labels, batch_dims=1)
        per_example += 0.1 * tf.nn.relu(1.0 - margin)
        loss = self.average(per_example)             # / GLOBAL batch
        if self.model.losses:                        # layer regularisers
          loss += tf.nn.scale_regularization_loss(tf.add_n(self.model.losses))
      grads = self.all_reduce(tape.gradient(loss,
                                            self.model.trainable_variables))
      grads, _ = self.clip_by_global_norm(grads)
      self.apply_gradients(grads)
      return {"loss": loss,
              "error_rate": self.average(1.0 - self.correct(labels, logits)),
              "margin": self.average(margin)}

  return MarginTrainer


def make_controller(strategy, train_steps):
  """A fresh model, optimizer, trainer and Controller (as a new process)."""
  # pylint: disable=g-import-not-at-top
  import keras
  import numpy as np
  import tensorflow as tf
  # pylint: enable=g-import-not-at-top
  keras.utils.set_random_seed(0)
  with strategy.scope():  # variables are mirrored on both replicas
    model = build_model(keras)
    optimizer = keras.optimizers.Adam(3e-3)
  trainer = make_trainer_class(tf)(
      model, optimizer, strategy, global_batch_size=FLAGS.global_batch_size)
  train_data = make_data(tf, np, 2048, seed=0)

  def train_input(start_step):
    # Endless global batches; a fixed shuffle seed makes the stream the same
    # in every run, so skipping what was consumed resumes exactly.
    return (train_data.shuffle(2048, seed=1).repeat()
            .batch(FLAGS.global_batch_size, drop_remainder=True)
            .skip(start_step))

  def eval_input():
    return make_data(tf, np, 500, seed=1).batch(FLAGS.global_batch_size)

  loop = framework.LoopConfig(
      train_steps=train_steps, steps_per_loop=10, checkpoint_every=20,
      summary_every=10, log_every=10)
  return framework.Controller(trainer, loop, FLAGS.model_dir,
                              train_input=train_input, eval_input=eval_input)


def main(argv):
  del argv
  framework.configure_cpu_devices(2)  # before TensorFlow makes its devices
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  # One strategy per process (two over the same devices can collide).
  strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
  half = FLAGS.train_steps // 2
  make_controller(strategy, half).run()  # stops halfway, as if preempted
  controller = make_controller(strategy, FLAGS.train_steps)
  controller.restore()
  print(f"resumed from step {controller.step}", flush=True)
  results = controller.run()
  print("eval: " + ", ".join(f"{k}={v:.4f}" for k, v in sorted(
      results.items())), flush=True)
  logging.info("TensorBoard: tensorboard --logdir %s", FLAGS.model_dir)


if __name__ == "__main__":
  cli.run_app(main)
