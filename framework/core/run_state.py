"""Whether a run already stopped at its target accuracy, or early.

A run that stops at `stop_at_accuracy` saves its checkpoint, then the chief
writes `target_reached.json` beside it (atomically):

    {"step": 5, "accuracy": 0.83, "stop_at_accuracy": 0.8, "train_steps": 40,
     "time_to_target_seconds": 12.3, "metrics": {...the final eval...}}

Relaunched with the same flags, the run restores that checkpoint and
`finished_at_target` says it is done: nothing trains, no checkpoint is
written, the time to target is not measured again. Raising `train_steps`
(or `--epochs`) or the target above the accuracy reached, or dropping the
target, continues the run, which then removes the record. A record of
another step (a later checkpoint was restored) is ignored.

A run stopped by early stopping (`early_stopping_patience`) records
`stopped_early.json` the same way: `{"step", "reason", "best_metric",
"patience", "train_steps", "metrics"}`; relaunched with the same
`best_metric` and no larger patience it trains nothing. A larger
patience, or none, continues it.
"""

import json
import os

from absl import logging
import tensorflow as tf

from framework.core import atomic

TARGET_FILE = "target_reached.json"
STOP_FILE = "stopped_early.json"


def record_target(model_dir, *, step, accuracy, stop_at_accuracy,
                  train_steps, time_to_target, metrics):
  """Writes the record (the chief, after the checkpoint at `step`)."""
  record = {"step": int(step), "accuracy": float(accuracy),
            "stop_at_accuracy": float(stop_at_accuracy),
            "train_steps": int(train_steps),
            "time_to_target_seconds": float(time_to_target),
            "metrics": {k: float(v) for k, v in metrics.items()}}
  atomic.write_text(os.path.join(model_dir, TARGET_FILE),
                    json.dumps(record, indent=2, sort_keys=True))


def read_target(model_dir, name=TARGET_FILE):
  """The record `record_target` (or `record_early_stop`, with `name=
  STOP_FILE`) wrote, or None (none, or unreadable: then the run trains on,
  as without a record)."""
  path = os.path.join(model_dir, name)
  try:
    if not tf.io.gfile.exists(path):
      return None
    with tf.io.gfile.GFile(path) as f:
      record = json.load(f)
    int(record["step"]), int(record["train_steps"])
    if name == TARGET_FILE:
      float(record["accuracy"])
    else:
      int(record["patience"]), str(record["best_metric"])
    return record
  except (ValueError, TypeError, KeyError, UnicodeDecodeError,
          tf.errors.OpError) as e:
    logging.warning("Ignoring %s (%s)", path, e)
    return None


def forget_target(model_dir, name=TARGET_FILE):
  """Removes the record (a run that goes on from it is no longer done)."""
  path = os.path.join(model_dir, name)
  if tf.io.gfile.exists(path):
    tf.io.gfile.remove(path)


def finished_at_target(record, step, train_steps, stop_at_accuracy):
  """Whether `record` says a run restored at `step` with these settings has
  nothing left to do."""
  return (record is not None and stop_at_accuracy is not None
          and int(record["step"]) == step
          and train_steps <= int(record["train_steps"])
          and stop_at_accuracy <= float(record["accuracy"]))


def continues_past_target(record, step, stop_at_accuracy):
  """Whether a run restored at `step` goes on past a target it already met
  (the same or a lower `stop_at_accuracy`), with more steps to train."""
  return (record is not None and stop_at_accuracy is not None
          and step >= int(record["step"])
          and stop_at_accuracy <= float(record["accuracy"]))


def record_early_stop(model_dir, *, step, reason, best_metric, patience,
                      train_steps, metrics):
  """Writes the early-stopping record (the chief, after the checkpoint at
  `step`)."""
  record = {"step": int(step), "reason": str(reason),
            "best_metric": str(best_metric), "patience": int(patience),
            "train_steps": int(train_steps),
            "metrics": {k: float(v) for k, v in (metrics or {}).items()}}
  atomic.write_text(os.path.join(model_dir, STOP_FILE),
                    json.dumps(record, indent=2, sort_keys=True))


def finished_early(record, step, best_metric, patience):
  """Whether the early-stopping `record` says a run restored at `step` with
  these settings has nothing left to do."""
  return (record is not None and patience is not None
          and int(record["step"]) == step
          and record["best_metric"] == best_metric
          and patience <= int(record["patience"]))
