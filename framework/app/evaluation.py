"""Evaluates a run's checkpoints: once, or as a side-car while it trains.

    evaluator = Evaluator(EvalConfig(model_dir="runs/cifar"))
    result = evaluator.evaluate()                  # the latest checkpoint
    for result in watch(config):                   # each new one, until the
      ...                                          # run's last step

The model is rebuilt from model_dir/model_info.json under any strategy, the
checkpoint's model weights and global step are restored (the optimizer is
not needed), and the whole test set is evaluated with the confusion matrix
summed over replicas. As in training: a run with an EMA of the weights is
evaluated with the averaged weights, and with its test-time augmentation
and loss. Results go to TensorBoard under model_dir/eval_<eval_name>
(default eval_standalone), never into the run's own model_dir/eval: the
training curves and the HParams table keep the run's own values.
"""

import dataclasses
import os
import re
import time

from absl import logging
import keras
import numpy as np
import tensorflow as tf

from models import registry
from framework.core.trainer import smoothed_sparse_categorical_loss
from framework.core import adapt, precision
from framework.app import export
from framework.app.config import DEFAULT_EVAL_NAME, EvalConfig  # pylint: disable=unused-import
from framework.core.checkpoints import manager
from framework.core.config import TrainerConfig
from framework.data import datasets, inputs
from framework.data.config import InputConfig
from framework.distribute import strategies
from framework.tasks import language_model, segmentation
from framework.errors import CheckpointError, ConfigError
from framework.tasks.segmentation import ConfusionTrainer, format_confusion
from framework.core.summaries import SummaryWriter, markdown_table
from framework.settings import default


@dataclasses.dataclass(frozen=True)
class EvalResult:
  checkpoint: str
  step: int
  metrics: dict
  confusion: np.ndarray
  class_names: tuple

  def lines(self):
    """Human-readable lines: metrics, then the confusion matrix."""
    out = [f"checkpoint {self.checkpoint} (step {self.step}): "
           f"{int(self.metrics['examples'])} examples"]
    width = max(len(k) for k in self.metrics)
    out += [f"  {k:<{width}}  {v:.6f}" for k, v in sorted(self.metrics.items())
            if k != "examples"]
    if self.confusion is None:  # a language model: no classes to confuse
      return out
    out.append("confusion matrix (" + ("pixels" if any(
        k == "mean_iou" for k in self.metrics) else "examples") + "):")
    out += format_confusion(self.confusion, self.class_names).splitlines()
    return out


def _load_info(model_dir):
  info = export.read_model_info(model_dir)
  if info is None:
    raise CheckpointError(f"model_dir={model_dir!r} has no "
                          f"{export.MODEL_INFO_FILE}: not a training run's "
                          "directory (or training has not started)")
  return info


class Evaluator:
  """Restores checkpoints of one run into a model and evaluates them."""

  def __init__(self, config, strategy=None, info=None):
    self.config = config
    self.info = export.with_model(info or _load_info(config.model_dir),
                                  config.model)
    # Before anything is loaded or imported.
    export.check_model_code(self.info, config.trust_model_code)
    self.strategy = strategy or strategies.make_strategy(config.strategy,
                                                         tpu=config.tpu)
    # Never the config's dataset in place of a run's own custom data.
    export.check_own_data(self.info, config.dataset, config.data_dir)
    name = config.dataset or self.info.get("dataset")
    data_dir = config.data_dir
    if data_dir is None and name == self.info.get("dataset"):
      data_dir = self.info.get("data_dir")
    self.dataset = datasets.load_dataset(
        name, data_dir,
        seed=self.info.get("seed", default(InputConfig, "seed")),
        **self.info.get("dataset_options", {}))
    if list(self.dataset.input_shape) != list(self.info["input_shape"]):
      raise ConfigError(
          f"dataset={name} has inputs {self.dataset.input_shape}; the model "
          f"was trained on {tuple(self.info['input_shape'])}")
    self.global_batch_size = (config.global_batch_size
                              or self.info.get("global_batch_size") or 128)
    custom = self.info.get("task") == registry.CUSTOM
    # A custom task's trainer evaluates it (its `eval_loss`): the run's code.
    task = (registry.CUSTOM if custom
            else language_model.task_name(self.dataset))
    per_pixel = task == "segmentation"
    trainer_cls = export.trainer_of(
        self.info, config.trust_model_code) if custom else {
            "segmentation": segmentation.SegmentationTrainer,
            language_model.TASK: language_model.LanguageModelTrainer,
        }.get(task, ConfusionTrainer)
    # The run's own compute precision, so that its numbers come out again.
    self.precision = self.info.get("mixed_precision") or "float32"
    if self.precision not in ("float32", "auto"):
      logging.info("evaluating in %s, the precision the run evaluated in "
                   "(model_info.json mixed_precision)", self.precision)
    policy = keras.mixed_precision.global_policy()
    try:
      if self.precision != "auto":
        precision.set_precision(self.precision)
      with self.strategy.scope():
        model = export.build_inference_model(
            self.info, trust_model_code=config.trust_model_code)
        optimizer = keras.optimizers.SGD()  # the Trainer needs one; unused
    finally:
      keras.mixed_precision.set_global_policy(policy)
    replicas = self.strategy.num_replicas_in_sync
    batch = -(-self.global_batch_size // replicas) * replicas
    extra = {}
    no_tta = default(TrainerConfig, "eval_tta")
    if self.info.get("eval_tta", no_tta) != no_tta:
      extra["eval_tta"] = self.info["eval_tta"]
    if self.info.get("label_smoothing") and not custom:
      extra["loss_fn"] = smoothed_sparse_categorical_loss(
          self.info["label_smoothing"])
    self.trainer = trainer_cls(model, optimizer, self.strategy,
                               global_batch_size=batch, **extra)
    # The EMA's averages, restored over the trainable weights (same order as
    # in training: the same builder made both models).
    self.averages = None
    if self.info.get("ema_decay"):
      self.averages = tf.train.Checkpoint(ema={"averages": [
          getattr(v, "value", v) for v in model.trainable_variables]})
    # What the trainer tracked beside its model (a VAE's decoder): its
    # evaluation may use them, so they come from the checkpoint too.
    tracked = manager.tracked_objects(self.trainer)
    self.checkpoint = tf.train.Checkpoint(
        model=model, global_step=self.trainer.global_step, **tracked)
    self.checkpoint_tracked = [
        v for v in tracked.values() if isinstance(v, keras.Layer)]
    self.samples = self.dataset.test_samples(3) if per_pixel else None
    self._writer = None

  @property
  def writer(self):
    """The eval SummaryWriter, created on first use (when there is a
    checkpoint to evaluate, before evaluating it): an evaluator that finds
    nothing to evaluate leaves model_dir untouched. A folder it cannot
    write is a ConfigError."""
    if self._writer is None:
      logdir = self.config.summary_dir
      try:
        self._writer = SummaryWriter(
            os.path.dirname(logdir), os.path.basename(logdir),
            enabled=strategies.is_chief(self.strategy))
      except (tf.errors.OpError, OSError) as e:
        # TensorFlow wraps the reason in the op's name: keep the reason.
        reason = re.sub(r"\{\{.*?\}\}\s*|\s*\[Op:.*$", "",
                        (getattr(e, "message", None) or str(e)).strip()
                        .splitlines()[0] if str(e).strip() else "")
        raise ConfigError(
            f"cannot write evaluation summaries to {logdir} "
            f"({reason or type(e).__name__}); nothing was evaluated: give "
            "eval_dir (--eval_dir) a folder you can write") from None
    return self._writer

  def restore(self, path):
    """Loads the model weights and global step of checkpoint `path`."""
    try:
      status = self.checkpoint.restore(path).expect_partial()
      status.assert_existing_objects_matched()
      if self.averages is not None:
        self.averages.restore(path).expect_partial(
        ).assert_existing_objects_matched()
    except (ValueError, AssertionError, tf.errors.OpError) as e:
      raise CheckpointError(
          f"checkpoint {path} does not fit model={self.info['model']} "
          f"({str(e).strip().splitlines()[0]})") from None
    # Adapted preprocessing layers: the restored state, not the built one.
    adapt.refresh(self.trainer.model)
    for value in self.checkpoint_tracked:
      adapt.refresh(value)
    return int(self.trainer.global_step.numpy())

  def evaluate(self, path=None):
    """Evaluates checkpoint `path` (default: config's, else the latest)."""
    path = path or self.config.checkpoint
    if path is None:
      # The newest intact one; a damaged newer one is named in a warning.
      path, _ = manager.latest_intact(self.config.model_dir)
    if path is None:
      raise CheckpointError(f"model_dir={self.config.model_dir!r} has no "
                            "checkpoint yet")
    if not tf.io.gfile.exists(path + ".index"):
      raise CheckpointError(f"checkpoint={path!r} does not exist (no "
                            f"{os.path.basename(path)}.index)")
    problem = manager.damage(path)
    if problem is not None:
      raise CheckpointError(f"checkpoint {path} is damaged: {problem}")
    writer = self.writer  # before the work: an unwritable folder fails now
    step = self.restore(path)
    metrics = self.trainer.evaluate(inputs.distribute_test(
        self.strategy, self.dataset, self.trainer.global_batch_size))
    result = EvalResult(path, step, metrics,
                        getattr(self.trainer, "last_confusion", None),
                        tuple(self.info["class_names"]))
    writer.scalars(step, {k: v for k, v in metrics.items()
                          if k != "examples"})
    if result.confusion is not None:
      writer.text(step, "confusion_matrix", _confusion_markdown(result))
    if self.samples is not None:
      images, masks = self.samples
      writer.images(step, segmentation.TRIPLETS_TAG,
                         segmentation.triplets(self.trainer.model, images,
                                               masks),
                         max_outputs=len(images))
    return result


def _confusion_markdown(result):
  rows = {f"{i} {name}": " ".join(str(int(v)) for v in row)
          for i, (name, row) in enumerate(zip(result.class_names,
                                              result.confusion))}
  return markdown_table(rows)


def watch(config, strategy=None):
  """Yields an EvalResult per new checkpoint until the run's last step.

  Waits for the run to start (model_info.json), then polls for checkpoints
  every `poll_seconds`; evaluates the newest one each time (skipping those
  written in between); stops after the checkpoint at the run's
  `train_steps`, or after `timeout_seconds` with nothing new: with a
  warning if it evaluated something, else with a CheckpointError.
  """
  deadline = time.time() + config.timeout_seconds
  info = export.read_model_info(config.model_dir)
  while info is None:
    if time.time() > deadline:
      raise CheckpointError(
          f"model_dir={config.model_dir!r}: no training run started there in "
          f"{config.timeout_seconds:g}s (no {export.MODEL_INFO_FILE})")
    time.sleep(config.poll_seconds)
    info = export.read_model_info(config.model_dir)
  evaluator = Evaluator(config, strategy=strategy, info=info)
  last = None
  while True:
    path = manager.latest(config.model_dir)
    if path is not None and path != last and manager.damage(path):
      # Rotated away while we looked, or damaged: wait for the next one.
      logging.warning("Skipping checkpoint %s: %s", path,
                      manager.damage(path))
      last = path
    elif path is not None and path != last:
      try:
        result = evaluator.evaluate(path)
      except tf.errors.NotFoundError as e:
        # Rotated away (max_to_keep) while we read it: take the next one.
        logging.info("Skipping checkpoint %s: %s", path, e)
        last = path
        continue
      last, deadline = path, time.time() + config.timeout_seconds
      yield result
      # The run may have been restarted with more steps: re-read its length.
      info = export.read_model_info(config.model_dir) or info
      if result.step >= info.get("train_steps", float("inf")):
        return
    elif time.time() > deadline:
      if last is None:
        # Exiting quietly here would look like a side-car that did its job.
        raise CheckpointError(
            f"model_dir={config.model_dir!r}: no checkpoint appeared in "
            f"{config.timeout_seconds:g}s after the run started (its "
            f"{export.MODEL_INFO_FILE} exists); nothing was evaluated")
      logging.warning("No new checkpoint in %s for %gs after %s; stopping "
                      "before the run's last step", config.model_dir,
                      config.timeout_seconds, last)
      return
    else:
      time.sleep(config.poll_seconds)
