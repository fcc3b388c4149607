"""What the Controller does to the datasets it is given before a trainer
sees them: the training batch size check, eval padding and distribution.

Input contract:
  train_input(start_step) returns endless global batches for steps
  `start_step, start_step + 1, ...`: skipping what the run already
  consumed is the function's job (a restored run calls it with the
  restored step; the framework never skips), e.g.
  `lambda start_step: ds.repeat().batch(64, drop_remainder=True)
  .skip(start_step)` for a deterministic `ds`. It returns either a
  `tf.data.Dataset` whose elements are whole global batches (leading
  dimension `global_batch_size`, split over the replicas with
  `strategy.experimental_distribute_dataset`), or an already distributed
  dataset or iterator (e.g. from `distribute_datasets_from_function`),
  used as is. A batch of another size is a `DataError` (before training
  if the dataset's static shape shows it, else when the batch comes), not
  a loss averaged over the wrong count.

  eval_input() returns one pass over the eval set, as a `tf.data.Dataset`
  of batches (the last one may be partial: for a `MaskedEvaluator` such as
  `framework.Trainer` it is re-batched to `global_batch_size`, the last
  batch padded with masked rows, see `framework.data.inputs.pad_batches`,
  and distributed, so that every replica gets a full batch) or an already
  distributed dataset (used as is: pad it yourself).

uint8 features of a plain dataset are scaled to float32 in [0, 1] first
(`framework.data.preprocessing`, the contract of the built-in datasets).
"""

import re
from typing import Any, Optional

from absl import logging
import tensorflow as tf

from framework.core import protocols
from framework.data import integrity, preprocessing
from framework.data.inputs import MaskedBatch, pad_batches
from framework.errors import DataError

_PARTIAL = "distloop_partial_batch"


def check_batch_size(dataset: tf.data.Dataset,
                     global_batch_size: int) -> tf.data.Dataset:
  """`dataset` with every batch's leading dimension checked against
  `global_batch_size` (DataError now if it is known to differ)."""
  dims = {t.shape[0] if t.shape.rank else None
          for t in tf.nest.flatten(dataset.element_spec)}
  if dims == {global_batch_size}:
    return dataset
  if None not in dims:
    raise DataError(
        f"train_input gives batches of {sorted(dims)[0]} examples; every "
        f"training batch must have global_batch_size={global_batch_size} "
        "examples (batch with drop_remainder=True)")

  def check(*batch):
    flat = tf.nest.flatten(batch)
    size = tf.shape(flat[0])[0]
    with tf.control_dependencies([tf.debugging.Assert(
        tf.equal(size, global_batch_size), [_PARTIAL, size])]):
      return tf.nest.map_structure(tf.identity, batch if len(batch) > 1
                                   else batch[0])

  return dataset.map(check)


def partial_batch_error(error: Exception,
                        global_batch_size: Optional[int]
                        ) -> Optional[DataError]:
  """The DataError for a failed `check_batch_size` assertion, else None."""
  if _PARTIAL not in str(error):
    return None
  size = re.search(_PARTIAL + r"\W*(\d+)", str(error))
  return DataError(
      f"train_input gave a batch of {size.group(1) if size else 'another'} "
      f"examples; every training batch must have global_batch_size="
      f"{global_batch_size} examples (a partial batch would be averaged over "
      "the wrong count: repeat() before batch(), or drop_remainder=True)")


class Batching:
  """Prepares a run's plain datasets for its trainer and evaluator.

  Reads, once: the trainer's `strategy`, `global_batch_size`
  (`BatchSized`: checked training batches) and `distribute_dataset`
  (`DatasetDistributing`: used instead of the strategy's); the
  evaluator's `global_batch_size` (`MaskedEvaluator`: padded eval batches).

  Args:
    trainer: a `LoopTrainer`.
    evaluator: a `LoopEvaluator`, or None.
  """

  def __init__(self, trainer: Any, evaluator: Any = None):
    self.global_batch_size = (trainer.global_batch_size if isinstance(
        trainer, protocols.BatchSized) else None)
    self._distribute = (
        trainer.distribute_dataset
        if isinstance(trainer, protocols.DatasetDistributing)
        else trainer.strategy.experimental_distribute_dataset)
    self.eval_batch_size = (evaluator.global_batch_size if isinstance(
        evaluator, protocols.MaskedEvaluator) else None)
    self._said_scaled = False

  def train(self, data: Any) -> Any:
    """A plain dataset from `train_input`, checked and distributed; any
    other input as it is."""
    if not isinstance(data, tf.data.Dataset):
      return data
    if self.global_batch_size is not None:
      data = check_batch_size(data, self.global_batch_size)
    return self.distribute(data)

  def pad_eval(self, data: tf.data.Dataset) -> tf.data.Dataset:
    """A plain eval dataset re-batched to the evaluator's global batch, the
    last batch padded (`MaskedBatch`), for evaluators that take masks."""
    if (self.eval_batch_size is None
        or isinstance(data.element_spec, MaskedBatch)):
      return data
    return pad_batches(data.rebatch(self.eval_batch_size),
                       self.eval_batch_size)

  def distribute(self, data: tf.data.Dataset) -> Any:
    """uint8 features scaled, then distributed (the trainer's way, else the
    strategy's)."""
    if preprocessing.has_uint8_features(data.element_spec):
      if not self._said_scaled:
        logging.info("the input gives uint8 features: scaled to float32 in "
                     "[0, 1] before the model (the preprocessing contract, "
                     "as for the built-in datasets)")
        self._said_scaled = True
      data = preprocessing.scale_dataset(data)
    return self._distribute(data)

  def train_error(self, error: Exception) -> Optional[DataError]:
    """The DataError a training call's InvalidArgumentError stands for (a
    damaged shard or record, a partial batch), else None."""
    return integrity.data_error(error) or partial_batch_error(
        error, self.global_batch_size)
