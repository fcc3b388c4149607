"""Language modelling: next-token cross-entropy in nats/token, perplexity.

A batch is `(tokens [B, T], targets [B, T])`, the model's output logits
[B, T, vocab]. Training needs nothing new from the trainer: the loss is
per token, `Trainer.average` takes each example's mean over its T tokens
and averages those over the global batch; every example has T tokens, so
that is the mean over all tokens of the global batch (nats/token).
Evaluation sums each example's mean token loss and next-token accuracy,
masked like every eval sum, and reports `perplexity = exp(loss)` beside
them. Training reports `perplexity` too: exp of the loop's mean loss.
"""

import math

import tensorflow as tf

from framework.core.trainer import Trainer
from framework.data.text import TASK, is_text

__all__ = ["LanguageModelTrainer", "is_language_model", "perplexity",
           "task_name", "TASK"]


def is_language_model(dataset):
  """Whether `dataset` is token sequences with next-token targets."""
  return is_text(dataset)


def task_name(dataset):
  """The task of `dataset`: language_model, segmentation or
  classification (what `models.check_task` compares a model with)."""
  from framework.tasks import segmentation  # pylint: disable=g-import-not-at-top
  if is_language_model(dataset):
    return TASK
  return ("segmentation" if segmentation.is_segmentation(dataset)
          else "classification")


def perplexity(loss):
  """exp(loss in nats/token); inf past float64's range, never an error."""
  try:
    return math.exp(loss)
  except OverflowError:
    return math.inf


class LanguageModelTrainer(Trainer):
  """A `Trainer` for next-token prediction; adds `perplexity` to the train
  and eval metrics."""

  def train(self, iterator, num_steps):
    results = dict(super().train(iterator, num_steps))
    # float64: exp of a large but finite loss must stay finite (the NaN
    # policy watches `loss` only).
    results["perplexity"] = tf.exp(tf.cast(results["loss"], tf.float64))
    return results

  def eval_results(self, totals):
    results = super().eval_results(totals)
    results["perplexity"] = perplexity(results["loss"])
    return results
