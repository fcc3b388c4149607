"""Evaluation: the eval step, its padded batches, test-time augmentation and the named eval sets."""

from __future__ import annotations

import dataclasses
import inspect
import re
import time
from typing import Any, Mapping, Optional, Callable

from absl import logging
import tensorflow as tf

from framework.core.config import TTA_MODES
from framework.data import integrity, preprocessing
from framework.data.inputs import MaskedBatch, pad_batches
from framework.errors import DataError, check_choice, ConfigError


# `Trainer.task`'s value for a trainer whose `compute_loss` is the whole task
# (models.registry.CUSTOM): no labels or classes needed.
CUSTOM = "custom"


class Evaluating:
  """Evaluation for a Trainer (see the module docstring)."""

  # None: the dataset's task (classification, segmentation, language
  # model). "custom": a model that is not a classifier (an autoencoder, a
  # VAE, a regression); `compute_loss` defines the loss from whatever the
  # batch holds (features alone for unlabeled data), the run does not check
  # the model's outputs against classes, and evaluation reports the mean
  # of `eval_loss`'s loss and metrics (no accuracy).
  task = None

  def eval_loss(self, batch: Any) -> tuple[tf.Tensor, Mapping[str, Any]]:
    """(per-example loss, per-example metrics) of an evaluation batch of a
    `task = "custom"` trainer: `compute_loss`'s. Override it where the
    model must run in inference mode (dropout, BatchNorm)."""
    return self.compute_loss(batch)

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
    if self.task == CUSTOM:
      return self._custom_sums(batch, mask)
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

  def _custom_sums(self, batch, mask):
    """`eval_loss`'s loss and metrics summed over the real rows (a scalar
    is taken as the batch's mean)."""
    loss, metrics = self.eval_loss(batch)
    rows = tf.shape(tf.nest.flatten(batch)[0])[0]
    if mask is None:
      mask = tf.ones([rows], tf.float32)
    examples = tf.reduce_sum(tf.cast(mask, tf.float32))

    def total(value):
      value = tf.convert_to_tensor(value)
      if value.shape.rank == 0:
        return tf.cast(value, tf.float32) * examples
      return masked_sum(_per_example(value), mask)

    return {"loss": total(loss),
            **{name: total(v) for name, v in (metrics or {}).items()},
            "examples": examples}

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
    return eval_logits(self.model, features, self.eval_tta)

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


# What the Controller does to the datasets it is given before a trainer
# sees them: the training batch size check, eval padding and distribution.
#
# Input contract:
#   train_input(start_step) returns endless global batches for steps
#   `start_step, start_step + 1, ...`: skipping what the run already
#   consumed is the function's job (a restored run calls it with the
#   restored step; the framework never skips), e.g.
#   `lambda start_step: ds.repeat().batch(64, drop_remainder=True)
#   .skip(start_step)` for a deterministic `ds`. It returns either a
#   `tf.data.Dataset` whose elements are whole global batches (leading
#   dimension `global_batch_size`, split over the replicas with
#   `strategy.experimental_distribute_dataset`), or an already distributed
#   dataset or iterator (e.g. from `distribute_datasets_from_function`),
#   used as is. A batch of another size is a `DataError` (before training
#   if the dataset's static shape shows it, else when the batch comes), not
#   a loss averaged over the wrong count.
#
#   eval_input() returns one pass over the eval set, as a `tf.data.Dataset`
#   of batches (the last one may be partial: for an evaluator with
#   `run_eval_step` such as `framework.Trainer` it is re-batched to `global_batch_size`, the last
#   batch padded with masked rows, see `framework.data.inputs.pad_batches`,
#   and distributed, so that every replica gets a full batch) or an already
#   distributed dataset (used as is: pad it yourself).
#
# uint8 features of a plain dataset are scaled to float32 in [0, 1] first
# (`framework.data.preprocessing`, the contract of the built-in datasets).
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

  Reads, once, the run's `LoopParts`: `global_batch_size` (checked
  training batches), `distribute_dataset` and `eval_batch_size` (padded
  eval batches).
  """

  def __init__(self, parts: Any):
    self.global_batch_size = parts.global_batch_size
    self._distribute = parts.distribute_dataset
    self.eval_batch_size = parts.eval_batch_size
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


# Test-time augmentation (TTA) for evaluation.
#
# `flip`: the model's logits on each image and on its horizontal mirror,
# averaged (the mean of the logits, as in the airbench CIFAR-10 speedruns,
# rather than the mean of the probabilities: one less softmax and the same
# arg-max in practice). For per-pixel outputs ([B, H, W, K]) the mirrored
# view's logits are mirrored back first, so that each pixel's two
# predictions are averaged.
#
# It is per example, so it is exact under every strategy and for a partial
# last batch: both views go through the model as one batch of 2B in inference
# mode (BatchNorm uses its moving statistics), then split.
def check_tta(mode):
  check_choice("eval_tta", mode, TTA_MODES)
  return mode


def flip_logits(model, images):
  """float32 mean of `model`'s logits on `images` [B, H, W, C] and on their
  horizontal mirrors."""
  mirrored = tf.reverse(images, axis=[2])
  both = tf.cast(model(tf.concat([images, mirrored], 0), training=False),
                 tf.float32)
  plain, flipped = tf.split(both, 2, axis=0)
  if flipped.shape.rank == 4:  # per pixel: mirror the prediction back
    flipped = tf.reverse(flipped, axis=[2])
  return 0.5 * (plain + flipped)


def eval_logits(model, features, mode):
  """The model's evaluation outputs under TTA `mode`."""
  if mode == "flip":
    return flip_logits(model, features)
  return model(features, training=False)


# Named eval sets: the run's own (`eval/`) and more (`eval_<name>/`).
#
#     Controller(..., eval_inputs={"eval": val_fn, "test": test_fn})
#
# Each evaluation evaluates every set, in order, at the same step: the
# default set `eval` (what `eval_input=` names) writes `model_dir/eval/`,
# another set `name` writes `model_dir/eval_<name>/`; each is exact under any
# replica count (a plain dataset's last batch is padded and masked,
# `framework.data.inputs.pad_batches`). The eval actions get the primary
# set's results (`eval`, else the first); the results of every set are in
# `controller.eval_results[split]`, which `stop_when`, `stop_at_accuracy`
# and `best_metric` read for a split such as `eval_test`.
#
# `LoopConfig.eval_steps=N` evaluates the first N global batches of each set
# only (Keras `validation_steps`): the log line says so and each set writes
# the scalar `eval_steps`. It applies to an eval input that returns a
# `tf.data.Dataset`, or a `Distributed` that says it is already limited;
# another distributed dataset cannot be cut, which is a ConfigError.
DEFAULT = "eval"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")


def split_of(name: str) -> str:
  """The summary folder (split) of eval set `name`: eval, eval_<name>."""
  return DEFAULT if name == DEFAULT else f"{DEFAULT}_{name}"


def check_name(name: Any, what: str = "eval_inputs") -> str:
  """`name` if it can name an eval set's folder, else ConfigError."""
  if not isinstance(name, str) or not _NAME.fullmatch(name) or (
      name == "standalone"):
    raise ConfigError(
        f"{what}: eval set name {name!r} must be letters, digits, _ and - "
        "(it names the folder eval_<name>; 'standalone' is evaluate.py's)")
  return name


@dataclasses.dataclass(frozen=True)
class Distributed:
  """An eval input's distributed dataset that already holds at most `steps`
  global batches (None: all of them): `eval_steps` then applies as is."""
  dataset: Any
  steps: Optional[int] = None


def collect(eval_input: Optional[Callable[[], Any]],
            eval_inputs: Optional[Mapping[str, Callable[[], Any]]]
            ) -> dict[str, Callable[[], Any]]:
  """{split: input function}, the default set first; ConfigError on a bad
  or repeated name."""
  sets = {}
  if eval_input is not None:
    sets[DEFAULT] = eval_input
  for name, fn in (eval_inputs or {}).items():
    check_name(name)
    if split_of(name) in sets:
      raise ConfigError(f"eval_inputs[{name!r}]: the default eval set is "
                        "given twice (eval_input= and eval_inputs['eval'])")
    if not callable(fn):
      raise ConfigError(f"eval_inputs[{name!r}]={fn!r} must be a function "
                        "() -> dataset")
    sets[split_of(name)] = fn
  if DEFAULT in sets:
    sets = {DEFAULT: sets.pop(DEFAULT), **sets}
  return sets


def results_of(controller: Any, split: str,
               results: Mapping[str, float]) -> Mapping[str, float]:
  """The latest results of eval split `split` (`eval`: `results`, what the
  eval actions get, where the run has no other); ConfigError if the run has
  no such set."""
  found = getattr(controller, "eval_results", None) or {DEFAULT: results}
  if split not in found:
    raise ConfigError(
        f"{split}/...: the run has no eval set named "
        f"{split[len(DEFAULT) + 1:] or DEFAULT!r} (its eval splits: "
        f"{', '.join(sorted(found))})")
  return found[split]


def _prepare(controller, split, data, steps):
  """`data` from an eval input, padded, cut to `steps` and distributed."""
  if isinstance(data, Distributed):
    if steps is not None and (data.steps is None or data.steps > steps):
      raise ConfigError(f"eval_steps={steps}: the {split} input says it "
                        f"holds {data.steps or 'all'} batches")
    return data.dataset
  if isinstance(data, tf.data.Dataset):
    data = controller.batching.pad_eval(data)
    if steps is not None:
      data = data.take(steps)
    return controller.batching.distribute(data)
  if steps is not None:
    raise ConfigError(
        f"eval_steps={steps}: the {split} input returned an already "
        f"distributed {type(data).__name__}, which cannot be cut; return a "
        "tf.data.Dataset (the framework pads and distributes it) or "
        "framework.core.evaluation.Distributed(dataset, steps)")
  return data


def evaluate_one(controller: Any, split: str, fn: Callable[[], Any],
                 step: int) -> dict:
  """Evaluates one set at `step`; writes its summaries and log line."""
  steps = controller.config.eval_steps
  data = _prepare(controller, split, fn(), steps)
  writer = controller.writer(split)
  with writer.as_default(step), tf.summary.record_if(True):
    results = dict(controller.evaluator.evaluate(data))
  scalars = {k: v for k, v in results.items() if k != "examples"}
  if controller.start_time is not None:
    # The wall-clock position of each evaluation on the run's time axis
    # (the origin of time_to_target): accuracy against seconds.
    scalars["elapsed_seconds"] = time.time() - controller.start_time
  if steps is not None:
    scalars["eval_steps"] = float(steps)
  writer.scalars(step, scalars)
  logging.info("%-5s step %d%s: %s", split, step,
               f" (eval_steps={steps}: the first {steps} global batches only)"
               if steps is not None else "", ", ".join(
                   f"{k}={v:.4f}" if k != "examples" else f"{k}={int(v)}"
                   for k, v in sorted(results.items())))
  return results
