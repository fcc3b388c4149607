"""A custom train step: label smoothing plus an input-gradient penalty.

Run it exactly like scripts/train.py (every train.py flag works):

    python scripts/examples/custom_step.py --model=mlp --dataset=synthetic \
        --strategy=mirrored --cpu_devices=2 --train_steps=50 \
        --label_smoothing=0.1 --gradient_penalty=0.01 --model_dir=/tmp/custom

Only the math changes; the trainer keeps it correct under every strategy:
average over the GLOBAL batch, one explicit all-reduce, clip the reduced
gradient, apply once.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))

from scripts import cli  # pylint: disable=g-import-not-at-top
cli.quiet_startup()  # Before TensorFlow is imported.
cli.import_tensorflow_quietly()  # This module imports it right away.

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags
import tensorflow as tf

import framework
from scripts import train

# --label_smoothing is train.py's flag (its evaluation loss smooths alike).
flags.DEFINE_float("gradient_penalty", 0.01, "Weight of the squared norm of "
                   "the loss gradient with respect to the inputs.")
FLAGS = flags.FLAGS


class LabelSmoothingTrainer(framework.Trainer):
  """Cross-entropy against smoothed targets, plus an input-gradient penalty."""

  label_smoothing = 0.1
  gradient_penalty = 0.01

  def train_step(self, batch):
    images, labels = batch
    num_classes = self.model.output_shape[-1]
    targets = tf.one_hot(labels, num_classes)
    targets = targets * (1 - self.label_smoothing) + (
        self.label_smoothing / num_classes)
    with tf.GradientTape() as tape:
      # Forward, watching the inputs for the penalty's inner gradient.
      with tf.GradientTape() as input_tape:
        input_tape.watch(images)
        logits = self.model(images, training=True)
        per_example = tf.nn.softmax_cross_entropy_with_logits(targets, logits)
      # Per-example penalty: each example's own input-gradient norm.
      input_grads = input_tape.gradient(per_example, images)
      penalty = tf.reduce_sum(tf.square(input_grads),
                              axis=tf.range(1, tf.rank(input_grads)))
      # Average over the GLOBAL batch so the replica shares sum to the mean.
      loss = self.average(per_example + self.gradient_penalty * penalty)
      # Layer regularisers: once per model, split over the replicas.
      if self.model.losses:
        loss += tf.nn.scale_regularization_loss(tf.add_n(self.model.losses))
    grads = tape.gradient(loss, self.model.trainable_variables)
    # One explicit SUM over replicas: the gradient of the global mean.
    grads = self.all_reduce(grads)
    # Clip the reduced gradient (per-replica clipping would clip shares).
    grads, grad_norm = self.clip_by_global_norm(grads)
    # Exactly one optimizer update.
    self.apply_gradients(grads)
    return {"loss": loss,
            "accuracy": self.average(self.correct(labels, logits)),
            "penalty": self.average(penalty),
            "grad_norm": self.replica_share(grad_norm)}


def main(argv):
  del argv
  LabelSmoothingTrainer.label_smoothing = FLAGS.label_smoothing
  LabelSmoothingTrainer.gradient_penalty = FLAGS.gradient_penalty
  train.run_main(trainer_cls=LabelSmoothingTrainer)


if __name__ == "__main__":
  app.run(main)
