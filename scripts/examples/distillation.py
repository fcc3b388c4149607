"""keras-io's knowledge distillation, ported: a student learns from the
labels and from a teacher's softened predictions.

Run it exactly like scripts/train.py (every train.py flag works; `--model` is
the student):

    python scripts/examples/distillation.py --model=mlp --dataset=synthetic \
        --strategy=mirrored --cpu_devices=2 --train_steps=50 \
        --teacher_model=cifar_cnn --model_dir=/tmp/distill

keras-io's `Distiller` overrides `train_step`; here only the loss changes
(`compute_loss`), so the trainer's step keeps it right under every strategy.
The teacher is a second model: created in `__init__` under
`self.strategy.scope()` and registered with `self.track(teacher=...)`, so
every checkpoint holds it and a run killed with kill -9 resumes exactly as an
uninterrupted one. `--teacher_weights` starts it from a weights file (e.g. a
train.py run's `model.weights.h5` of `--teacher_model`); without it the
teacher is random, which only shows the mechanics.
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
import models
from distloop_cli import train

flags.DEFINE_string("teacher_model", "mlp", "The teacher's model (a name or "
                    "an import path, as --model).")
flags.DEFINE_string("teacher_weights", None, "A weights file of the teacher "
                    "(model.weights.h5 of a train.py run); default random.")
flags.DEFINE_float("distillation_alpha", 0.1, "Weight of the student's own "
                   "loss; 1 - alpha weighs the distillation loss.")
flags.DEFINE_float("distillation_temperature", 10.0, "Softmax temperature "
                   "of both models' logits in the distillation loss.")
FLAGS = flags.FLAGS


class Distiller(framework.Trainer):
  """keras-io's Distiller as a `compute_loss`: alpha * cross-entropy +
  (1 - alpha) * T^2 * KL(teacher_T || student_T), per example.

  Args:
    teacher_model: the teacher's model name, built for the student's input
      shape and classes.
    teacher_weights: its weights file, or None.
    alpha, distillation_temperature: keras-io's alpha and temperature.
    **kwargs: `framework.Trainer`'s.
  """

  def __init__(self, model, optimizer, strategy, *, teacher_model="mlp",
               teacher_weights=None, alpha=0.1, distillation_temperature=10.0,
               **kwargs):
    super().__init__(model, optimizer, strategy, **kwargs)
    self.alpha = float(alpha)
    self.temperature = float(distillation_temperature)
    # A second model: under the strategy (one copy per replica), tracked
    # (in every checkpoint, restored on resume).
    with strategy.scope():
      self.teacher = models.build_model(
          teacher_model, model.input_shape[1:], model.output_shape[-1])
      if teacher_weights:
        self.teacher.load_weights(teacher_weights)
    self.teacher.trainable = False
    self.track(teacher=self.teacher)

  def compute_loss(self, batch):
    images, labels = batch
    logits = self.model(images, training=True)
    teacher_logits = tf.stop_gradient(self.teacher(images, training=False))
    t = self.temperature
    teacher_p = tf.nn.softmax(tf.cast(teacher_logits, tf.float32) / t)
    student_log_p = tf.nn.log_softmax(tf.cast(logits, tf.float32) / t)
    # KL(teacher || student) per example, as keras.losses.KLDivergence.
    kl = tf.reduce_sum(teacher_p * (tf.math.log(teacher_p + 1e-12)
                                    - student_log_p), axis=-1)
    student = self.loss_fn(labels, logits)
    loss = self.alpha * student + (1 - self.alpha) * kl * t * t
    return loss, {"accuracy": self.correct(labels, logits),
                  "student_loss": student, "distillation_loss": kl}


def main(argv):
  del argv
  train.run_main(trainer_cls=functools.partial(
      Distiller, teacher_model=FLAGS.teacher_model,
      teacher_weights=FLAGS.teacher_weights,
      alpha=FLAGS.distillation_alpha,
      distillation_temperature=FLAGS.distillation_temperature))


if __name__ == "__main__":
  cli.run_app(main)
