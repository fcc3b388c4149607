"""The best checkpoint and early stopping: an eval action on `best_metric`.

After each evaluation that improves `LoopConfig.best_metric` (by more than
`best_min_delta`, in `best_mode`'s direction), the chief replaces
`model_dir/best/` in one rename (Keras `ModelCheckpoint(save_best_only=
True)`, the Model Garden's best-checkpoint exporter):

    best/ckpt.index, ckpt.data-*   the run's checkpoint at that step (model,
                                   optimizer, global step, EMA): evaluate.py
                                   --weights=best evaluates it as training did
    best/model.weights.h5          the weights evaluation used (the EMA's
                                   averages when there is one): predict.py
                                   --weights=best
    best/model_info.json           the run's, so that best/ stands alone
    best/best.json                 {"metric", "split", "value", "mode",
                                   "step", "epoch", "time", "metrics"}

Every worker takes part in the save (it is a collective under a multi-
worker strategy): the others write to a temporary folder that they remove.
`--keep_checkpoints` never touches `best/`. A process killed while it
writes leaves the previous `best/` (or, killed between the two renames,
`.tmp_best.old`, which `resolve` reads and the next run puts back).

A relaunch reads the best so far back from `best.json`; `best_history.json`
(every evaluation's value) lets the patience count continue where the
restored checkpoint was. With `early_stopping_patience`, `patience`
evaluations in a row without an improvement (from `early_stopping_start_
step` on) stop the run as a finished one (`run_files.STOP_FILE`; Keras
`EarlyStopping`); `restore_best_on_stop` then puts the best weights back
before the run's final evaluation and weights file.
"""

import json
import math
import os
import shutil
import time
from typing import Any, Mapping, Optional

from absl import logging
import tensorflow as tf

from framework.core import actions, adapt
from framework.core import evaluation
from framework.core.checkpoints import run_files
from framework.core.config import parse_metric
from framework.distribute import strategies
from framework.errors import CheckpointError, ConfigError


BEST_DIR = "best"
BEST_FILE = "best.json"
HISTORY_FILE = "best_history.json"
CHECKPOINT_NAME = "ckpt"
WEIGHTS_NAME = "model.weights.h5"
# What `write_atomically` names the folder while writing it, and the old
# one while it swaps them.
_TMP = run_files.TMP_PREFIX + BEST_DIR
_OLD = _TMP + ".old"
_MAX_LIKE = ("acc", "auc", "iou", "precision", "recall", "f1")


def resolve_mode(metric: str, mode: str) -> str:
  """`max` or `min` for `metric` (`auto`: max for accuracy-like names)."""
  if mode != "auto":
    return mode
  return "max" if any(word in metric.lower() for word in _MAX_LIKE) else "min"


def best_dir(model_dir: str) -> Optional[str]:
  """`model_dir/best`, or the previous one a killed swap left aside; None
  when there is neither."""
  for name in (BEST_DIR, _OLD):
    path = os.path.join(model_dir, name)
    if tf.io.gfile.exists(os.path.join(path, BEST_FILE)):
      return path
  return None


def read_best(model_dir: str) -> Optional[dict]:
  """The `best.json` of `model_dir`'s best checkpoint, or None."""
  folder = best_dir(model_dir)
  if folder is None:
    return None
  path = os.path.join(folder, BEST_FILE)
  try:
    with tf.io.gfile.GFile(path) as f:
      record = json.load(f)
    float(record["value"]), int(record["step"]), str(record["metric"])
    return record
  except (ValueError, TypeError, KeyError, UnicodeDecodeError) as e:
    raise CheckpointError(f"{path} is damaged ({e}); delete {folder} to "
                          "start a new best checkpoint") from None


def resolve(model_dir: str, what: str = "checkpoint") -> str:
  """The best checkpoint's prefix (`what="checkpoint"`) or weights file
  (`"weights"`) in `model_dir`; CheckpointError when there is none."""
  folder = best_dir(model_dir) if os.path.isdir(model_dir) else None
  if folder is None:
    raise CheckpointError(
        f"model_dir={model_dir!r} has no best checkpoint ({BEST_DIR}/"
        f"{BEST_FILE}): train with --best_metric=eval/accuracy (or another "
        "eval scalar) to keep one")
  return os.path.join(folder, CHECKPOINT_NAME if what == "checkpoint"
                      else WEIGHTS_NAME)


def recover(model_dir: str) -> None:
  """The chief's clean-up of a killed swap: `.tmp_best` (half written) is
  removed; `.tmp_best.old` goes back to `best/` if that is missing."""
  tmp, old = (os.path.join(model_dir, n) for n in (_TMP, _OLD))
  best = os.path.join(model_dir, BEST_DIR)
  if os.path.isdir(tmp):
    shutil.rmtree(tmp, ignore_errors=True)
  if os.path.isdir(old):
    if os.path.isdir(best):
      shutil.rmtree(old, ignore_errors=True)
    else:
      logging.warning("Putting back %s as %s (a run was killed while it "
                      "replaced it)", old, best)
      os.rename(old, best)


class BestCheckpoint:
  """The eval action that keeps `best/` and stops early (see the module).

  Args:
    controller: the Controller (its trainer, checkpoint, model_dir and
      writers are read; `on_train_end` gets the end-of-run callable). The
      action changes no Controller field: it returns `actions.Stop` to stop
      early, and the results the run reports where they change.
    config: its `LoopConfig` (`best_*`, `early_stopping_*`,
      `restore_best_on_stop`).
  """

  def __init__(self, controller: Any, config: Any):
    self.controller = controller
    self.config = config
    self.metric = config.best_metric
    self.split, self.name = parse_metric(config.best_metric)
    self.mode = resolve_mode(self.name, config.best_mode)
    self.model_dir = controller.model_dir
    strategy = controller.parts.strategy
    self.chief = strategies.is_chief(strategy)
    self.task = strategies.task_info(strategy)
    if self.chief and os.path.isdir(self.model_dir):
      recover(self.model_dir)
    self.best = read_best(self.model_dir)
    if self.best is not None and self.best["metric"] != self.metric:
      logging.warning("%s kept the best %s; this run keeps the best %s: the "
                      "next evaluation replaces it", best_dir(self.model_dir),
                      self.best["metric"], self.metric)
      self.best = None
    self.history = self._read_history()
    self.stopped = False
    controller.on_train_end.append(self._on_train_end)

  # The record of a relaunch.

  def _read_history(self):
    path = os.path.join(self.model_dir, HISTORY_FILE)
    try:
      with tf.io.gfile.GFile(path) as f:
        record = json.load(f)
      if record.get("metric") == self.metric:
        return [(int(s), float(v)) for s, v in record["evaluations"]]
    except (tf.errors.NotFoundError, ValueError, TypeError, KeyError):
      pass
    return []

  def finished(self, step: int) -> Optional[dict]:
    """The early-stop record if the run restored at `step` already stopped
    early with these settings (then it says so in one line; the run reports
    the record's `metrics`); else None, and an old record is forgotten."""
    record = run_files.read_target(self.model_dir, run_files.STOP_FILE)
    if run_files.finished_early(record, step, self.metric,
                                self.config.early_stopping_patience):
      logging.info("Already finished: %s at step %d (%s); nothing to train "
                   "(raise early_stopping_patience or unset it to continue)",
                   record["reason"], step, run_files.STOP_FILE)
      self.stopped = True
      return record
    if record is not None and self.chief:
      run_files.forget_target(self.model_dir, run_files.STOP_FILE)
    return None

  # The action.

  def improves(self, value: float) -> bool:
    if not math.isfinite(value):
      return False
    if self.best is None:
      return True
    best, delta = float(self.best["value"]), self.config.best_min_delta
    return value > best + delta if self.mode == "max" else value < best - delta

  def __call__(self, step: int,
               results: Mapping[str, float]) -> Optional[actions.Stop]:
    outputs = evaluation.results_of(self.controller, self.split, results)
    if self.name not in outputs:
      raise ConfigError(
          f"best_metric={self.metric}: the {self.split} results have no "
          f"{self.name!r} (only {', '.join(sorted(outputs))})")
    value = float(outputs[self.name])
    if self.improves(value):
      self.export(step, value, outputs)
    # Evaluations at or after `step` belong to a timeline a relaunch undid.
    self.history = [(s, v) for s, v in self.history if s < step]
    self.history.append((step, value))
    if self.chief:
      run_files.write_text(os.path.join(self.model_dir, HISTORY_FILE),
                        json.dumps({"metric": self.metric,
                                    "evaluations": self.history}))
    patience = self.config.early_stopping_patience
    if patience is None or self.stopped:
      return
    best_step = int(self.best["step"]) if self.best else -1
    waited = sum(1 for s, _ in self.history if s > best_step
                 and s >= self.config.early_stopping_start_step)
    if waited >= patience:
      return self._stop(step, patience)
    return None

  def _stop(self, step, patience):
    """Records why in TensorBoard; the Controller applies the `Stop`."""
    c = self.controller
    reason = (f"early stopping: {self.metric} did not improve by more than "
              f"{self.config.best_min_delta:g} in {patience} evaluations "
              f"(best {float(self.best['value']):.4f} at step "
              f"{int(self.best['step'])})")
    self.stopped = True
    writer = c.writer(self.split)
    writer.text(step, "stop_reason", reason)
    writer.scalars(step, {"early_stopping_step": float(step)})
    return actions.Stop(reason)

  def export(self, step: int, value: float,
             outputs: Mapping[str, float]) -> None:
    """Writes `best/` for the evaluation at `step` (every worker calls it)."""
    c = self.controller
    spe = getattr(c, "steps_per_epoch", None)
    record = {"metric": self.metric, "split": self.split, "value": value,
              "mode": self.mode, "step": int(step),
              "epoch": round(step / spe, 4) if spe else None,
              "time": time.time(),
              "metrics": {k: float(v) for k, v in outputs.items()}}
    if not self.chief:
      # Its part of the collective save, written where nobody reads it.
      task_type, task_id = self.task
      tmp = os.path.join(self.model_dir,
                         f".tmp_worker_best_{task_type}_{task_id}")
      c.checkpoint.write(os.path.join(tmp, CHECKPOINT_NAME))
      shutil.rmtree(tmp, ignore_errors=True)
      self.best = record
      return

    def write(tmp):
      tf.io.gfile.makedirs(tmp)
      c.checkpoint.write(os.path.join(tmp, CHECKPOINT_NAME))
      _save_eval_weights(c.parts, os.path.join(tmp, WEIGHTS_NAME))
      info = os.path.join(self.model_dir, "model_info.json")
      if tf.io.gfile.exists(info):
        tf.io.gfile.copy(info, os.path.join(tmp, "model_info.json"))
      with tf.io.gfile.GFile(os.path.join(tmp, BEST_FILE), "w") as f:
        f.write(json.dumps(record, indent=2, sort_keys=True))

    run_files.write_atomically(os.path.join(self.model_dir, BEST_DIR), write)
    self.best = record
    logging.info("best %s=%.4f at step %d: wrote %s", self.metric, value,
                 step, os.path.join(self.model_dir, BEST_DIR))

  # The end of the run.

  def _on_train_end(self, step: int) -> Optional[dict]:
    """Records the early stop; with `restore_best_on_stop` restores the best
    weights and returns their evaluation (what the run then reports)."""
    c = self.controller
    if not self.stopped:
      return None
    if self.chief and c.stop_reason is not None:
      run_files.record_early_stop(
          self.model_dir, step=step, reason=c.stop_reason,
          best_metric=self.metric,
          patience=self.config.early_stopping_patience,
          train_steps=self.config.train_steps,
          metrics=(self.best or {}).get("metrics") if (
              self.config.restore_best_on_stop) else c.last_eval)
    if self.config.restore_best_on_stop and self.best is not None:
      path = resolve(self.model_dir)
      restore_weights(c, path)
      logging.info("restored the best weights (%s=%.4f at step %d) from %s",
                   self.metric, float(self.best["value"]),
                   int(self.best["step"]), path)
      # The stop came from the evaluation at `step`: the run reports the
      # best one instead of evaluating again.
      return dict(self.best["metrics"])
    return None


def restore_weights(controller: Any, path: str) -> None:
  """Loads the model (and EMA) of checkpoint `path`, not its step or
  optimizer, into `controller`'s trainer."""
  objects = {"model": controller.parts.model}
  ema = controller.parts.ema
  if ema is not None:
    objects.update(ema.checkpoint_items())
  tf.train.Checkpoint(**objects).restore(path).expect_partial(
  ).assert_existing_objects_matched()
  adapt.refresh(controller.parts.model)


def _save_eval_weights(parts, path):
  """The weights evaluation uses (EMA averages swapped in), as `.h5`."""
  model = parts.export_model()
  with parts.averaged_weights():
    model.save_weights(path)


def from_config(controller: Any, config: Any) -> Optional[BestCheckpoint]:
  """The action `config.best_metric` asks for, added to `controller`'s eval
  actions; None without one."""
  if config.best_metric is None:
    return None
  action = BestCheckpoint(controller, config)
  controller.eval_actions.append(action)
  return action
