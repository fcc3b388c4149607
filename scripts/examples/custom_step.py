"""A custom loss: cross-entropy plus an input-gradient penalty.

Run it exactly like scripts/train.py (every train.py flag works):

    python scripts/examples/custom_step.py --model=mlp --dataset=synthetic \
        --strategy=mirrored --cpu_devices=2 --train_steps=50 \
        --label_smoothing=0.1 --gradient_penalty=0.01 --model_dir=/tmp/custom

Only the loss changes (`compute_loss`); the trainer's `train_step` keeps it
correct under every strategy and with every step feature (--grad_accum_steps,
--mixed_precision=float16, --ema_decay, --nan_policy=skip): average over the
GLOBAL batch, one explicit all-reduce, clip the reduced gradient, apply once.
"""

import functools

# The installed package only (`pip install -e .`): a copy of this file runs
# from any folder.
from distloop_cli import cli
cli.quiet_startup()  # Before TensorFlow is imported: train.py's quiet logs.
cli.import_tensorflow_quietly()  # This module imports it right away.

from absl import flags  # pylint: disable=g-import-not-at-top
import tensorflow as tf

import framework
from distloop_cli import train

# --label_smoothing is train.py's flag (its evaluation loss smooths alike).
flags.DEFINE_float("gradient_penalty", 0.01, "Weight of the squared norm of "
                   "the loss gradient with respect to the inputs.")
FLAGS = flags.FLAGS


class GradientPenaltyTrainer(framework.Trainer):
  """The run's loss (`loss_fn`: cross-entropy, smoothed by --label_smoothing)
  plus each example's squared input-gradient norm.

  Args:
    gradient_penalty: the penalty's weight.
    **kwargs: `framework.Trainer`'s.
  """

  def __init__(self, *args, gradient_penalty=0.01, **kwargs):
    super().__init__(*args, **kwargs)
    self.gradient_penalty = float(gradient_penalty)

  def compute_loss(self, batch):
    images, labels = batch
    # Forward, watching the inputs for the penalty's inner gradient.
    with tf.GradientTape() as input_tape:
      input_tape.watch(images)
      logits = self.model(images, training=True)
      per_example = self.loss_fn(labels, logits)
    # Per-example penalty: each example's own input-gradient norm.
    input_grads = input_tape.gradient(per_example, images)
    penalty = tf.reduce_sum(tf.square(tf.cast(input_grads, tf.float32)),
                            axis=tf.range(1, tf.rank(input_grads)))
    # Per-example values: the trainer averages them over the GLOBAL batch.
    return per_example + self.gradient_penalty * penalty, {
        "accuracy": self.correct(labels, logits), "penalty": penalty}


# The name this example had before its loss moved to `compute_loss`.
LabelSmoothingTrainer = GradientPenaltyTrainer


def main(argv):
  del argv
  # Options reach the trainer as constructor arguments.
  train.run_main(trainer_cls=functools.partial(
      GradientPenaltyTrainer, gradient_penalty=FLAGS.gradient_penalty))


if __name__ == "__main__":
  cli.run_app(main)
