"""The evaluation step of a Trainer: masked sums over padded batches.

    per replica:  run_eval_step(batch)      # a MaskedBatch or a plain one
                    eval_step(batch, mask)  # eval_logits -> eval_sums
    over replicas: SUM, accumulated over the whole dataset in one graph call
    eval_results(totals)                    # sums -> reported metrics

Padding rows (mask 0) are left out of every sum, so a padded last batch
gives exact counts. `Evaluating` is a mixin of `framework.Trainer`: it reads
the trainer's `model`, `strategy`, `loss_fn`, `eval_tta`, `correct` and
`averaged_weights()`.
"""

from __future__ import annotations

import inspect
from typing import Any, Mapping

from absl import logging
import tensorflow as tf

from framework.core import tta
from framework.data.inputs import MaskedBatch


class Evaluating:
  """Evaluation for a Trainer (see the module docstring)."""

  def eval_step(self, batch: Any,
                mask: tf.Tensor | None = None) -> dict[str, tf.Tensor]:
    """Sums over this replica's part of an evaluation batch.

    The one eval step of every task: `eval_logits` gives the outputs (TTA,
    or a split model's placed forward pass), `eval_sums` what is summed.

    Args:
      batch: `(features, labels)`, padded to its full size.
      mask: float32 [rows]: 1.0 for real examples, 0.0 for padding rows
        (None: every row is real). Every sum must leave padding out.

    Returns:
      A dict of sums; `examples` counts the real examples.
    """
    features, labels = batch
    logits = self.eval_logits(features)
    if _takes_mask(self.eval_sums):
      return self.eval_sums(labels, logits, mask=mask)
    # An override without `mask`: give it the real rows only (the model
    # already ran on the whole padded batch).
    _warn_no_mask(self.eval_sums)
    if mask is not None:
      labels, logits = real_rows((labels, logits), mask)
    return self.eval_sums(labels, logits)

  def eval_sums(self, labels: tf.Tensor, logits: tf.Tensor,
                mask: tf.Tensor | None = None) -> dict[str, tf.Tensor]:
    """Loss and accuracy summed over the real examples (a per-pixel value
    is first averaged over its example's pixels), and their count.

    `mask` (float32 [rows], 0.0 for padding; None: all real) weighs each
    example: an override passes it on to `super().eval_sums` and leaves the
    padding rows out of its own sums (`masked_sum`, or `weights=mask` in
    `tf.math.confusion_matrix`).
    """
    loss = _per_example(self.loss_fn(labels, logits))
    if mask is None:
      mask = tf.ones_like(loss)
    return {"loss": masked_sum(loss, mask),
            "accuracy": masked_sum(_per_example(self.correct(labels, logits)),
                                   mask),
            "examples": tf.reduce_sum(tf.cast(mask, tf.float32))}

  def run_eval_step(self, batch):
    """`eval_step` on one replica's batch (a `MaskedBatch` or a plain one).

    An `eval_step` override without a `mask` argument gets the real rows of
    a padded batch only (possibly 0 rows: add `mask=None` to it to keep the
    model's batch full and static).
    """
    mask = None
    if isinstance(batch, MaskedBatch):
      batch, mask = batch
    if _takes_mask(self.eval_step):
      return self.eval_step(batch, mask=mask)
    _warn_no_mask(self.eval_step)
    return self.eval_step(batch if mask is None else real_rows(batch, mask))

  def eval_logits(self, features: Any) -> tf.Tensor:
    """The model's outputs for evaluation (with `eval_tta` applied)."""
    return tta.eval_logits(self.model, features, self.eval_tta)

  def eval_results(self, totals: Mapping[str, Any]) -> dict[str, float]:
    """Turns the summed `eval_step` outputs into the reported metrics."""
    count = totals["examples"]
    results = {k: v / count for k, v in totals.items() if k != "examples"}
    results["examples"] = count
    return results

  def _eval_totals(self, batch):
    totals = self._reduce(self.strategy.run(self.run_eval_step,
                                            args=(batch,)))
    return {k: tf.cast(v, tf.float64) for k, v in totals.items()}

  def _eval_loop_fn(self, iterator):
    totals = self._eval_totals(next(iterator))
    for batch in iterator:
      batch_totals = self._eval_totals(batch)
      totals = {k: totals[k] + batch_totals[k] for k in totals}
    return totals

  def evaluate(self, distributed_dataset: Any) -> dict[str, Any]:
    """Evaluates over the whole dataset (`MaskedBatch`es: padding rows
    left out of every sum; plain batches: every row), with the EMA weights
    when there is an EMA."""
    with self.averaged_weights():
      totals = self._eval_loop(iter(distributed_dataset))
    return {k: float(v) for k, v in
            self.eval_results({k: v.numpy() for k, v in totals.items()}).items()}




def masked_sum(values, mask):
  """Sum of `values` [rows] weighted by `mask` [rows]; padding rows (mask 0)
  count nothing even when their values are not finite. No mask: the sum."""
  values = tf.cast(values, tf.float32)
  if mask is None:
    return tf.reduce_sum(values)
  mask = tf.cast(mask, tf.float32)
  return tf.reduce_sum(tf.where(mask > 0, values * mask, 0.0))


def real_rows(batch, mask):
  """The rows of `batch` (a nest of tensors) whose `mask` is not 0."""
  keep = tf.cast(mask, tf.float32) > 0
  return tf.nest.map_structure(lambda t: tf.boolean_mask(t, keep), batch)


def _takes_mask(method):
  """Whether `method` accepts a `mask` keyword argument."""
  try:
    parameters = inspect.signature(method).parameters.values()
  except (TypeError, ValueError):
    return False
  return any(p.name == "mask" or p.kind == p.VAR_KEYWORD for p in parameters)


_WARNED = set()


def _warn_no_mask(method):
  """Once per method: an override without `mask` gets unpadded rows."""
  name = getattr(method, "__qualname__", repr(method))
  if name not in _WARNED:
    _WARNED.add(name)
    logging.warning(
        "%s takes no `mask` argument: it is given only the real rows of each "
        "padded evaluation batch (a dynamic shape, possibly 0 rows); add "
        "`mask=None` and leave rows with mask 0 out of its sums", name)


def _per_example(values):
  """Each example's mean over its trailing (pixel) dimensions."""
  values = tf.cast(values, tf.float32)
  if values.shape.rank > 1:
    values = tf.reduce_mean(tf.reshape(values, [tf.shape(values)[0], -1]), 1)
  return values

