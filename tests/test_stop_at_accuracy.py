"""--stop_at_accuracy stops at the first evaluation reaching the target and
records time_to_target_seconds; the recipe's flags reach the run."""

import os
import re

import h5py
import numpy as np
import pytest
import tensorflow as tf

from framework import ConfigError, LoopConfig
from test_train_script import events, scalars, train

RECIPE_FLAGS = ["--strategy=mirrored", "--cpu_devices=2", "--steps_per_loop=5",
                "--eval_every=5", "--checkpoint_every=0", "--summary_every=5",
                "--log_every=5", "--nesterov", "--lr_schedule=onecycle",
                "--label_smoothing=0.1", "--ema_decay=0.9", "--ema_warmup",
                "--eval_tta=flip", "--mixed_precision=auto",
                "--lr_scaling=linear", "--lr_base_batch_size=16"]


def h5_arrays(path):
  arrays = []
  with h5py.File(path) as f:
    f.visititems(lambda name, obj: arrays.append((name, obj[()]))
                 if isinstance(obj, h5py.Dataset) else None)
  return dict(arrays)


def test_an_easy_target_stops_early_and_records_the_time(tmp_path):
  proc = train(tmp_path, *RECIPE_FLAGS, "--train_steps=40",
               "--stop_at_accuracy=0.01")
  log = proc.stderr
  assert re.search(r"mixed_precision=auto: (float32|bfloat16)", log)
  assert "learning_rate 0.05 for batch 16 -> 0.1 for batch 32" in log
  match = re.search(r"target accuracy 0\.0100 reached at step 5: "
                    r"accuracy=[\d.]+ time_to_target_seconds=([\d.]+)", log)
  assert match, log[-3000:]
  # Stopped at the first evaluation: the checkpoint and artifacts of step 5.
  assert tf.train.latest_checkpoint(str(tmp_path)).endswith("-5")
  assert "train step 10/" not in log
  recorded = scalars(events(str(tmp_path / "eval")), "time_to_target_seconds")
  assert list(recorded) == [5]
  assert recorded[5] == pytest.approx(float(match.group(1)), abs=0.1)
  assert recorded[5] > 0
  accuracy = scalars(events(str(tmp_path / "eval")), "accuracy")
  assert list(accuracy) == [5]  # no second evaluation after stopping
  averaged = h5_arrays(tmp_path / "model.weights.h5")
  raw = h5_arrays(tmp_path / "model.raw.weights.h5")
  assert averaged.keys() == raw.keys()
  assert any(not np.array_equal(averaged[k], raw[k]) for k in raw)
  assert os.path.isdir(tmp_path / "export")


def test_an_unreachable_target_trains_to_the_end(tmp_path):
  proc = train(tmp_path, "--train_steps=15", "--eval_every=5",
               "--eval_start_step=10", "--stop_at_accuracy=1.0")
  assert "target accuracy 1.0000 not reached in 15 steps" in proc.stderr
  acc = events(str(tmp_path / "eval"))
  assert "time_to_target_seconds" not in acc.Tags()["tensors"]
  # Periodic evaluations from eval_start_step on, and the final one.
  assert list(scalars(acc, "accuracy")) == [10, 15]


@pytest.mark.parametrize("value", [0.0, 1.5, -0.2])
def test_bad_target_is_rejected(value):
  with pytest.raises(ConfigError, match="stop_at_accuracy"):
    LoopConfig(train_steps=10, stop_at_accuracy=value)
