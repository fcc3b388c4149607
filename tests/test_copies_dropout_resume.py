"""A data x pipeline mesh whose model has Dropout resumes exactly: copy 0's
seed generators are checkpointed, the other copies' were not and restarted
their dropout draws on a relaunch (a resumed run's weights then differed
from an uninterrupted run's by ~3e-2); the copies now take copy 0's draw
counter, each keeping its own seed."""

import re

import pytest

from tests.helpers import run_script

BUILDER = '''
import keras


def build(input_shape, num_classes):
  return keras.Sequential([
      keras.Input(input_shape), keras.layers.Flatten(),
      keras.layers.Dense(16, activation="relu"), keras.layers.Dropout(0.5),
      keras.layers.Dense(16, activation="relu"),
      keras.layers.Dense(num_classes)])
'''

FLAGS = ("--model=my_dropout:build", "--dataset=synthetic", "--seed=4242",
         "--global_batch_size=16", "--cpu_devices=4",
         "--mesh=data:2,pipeline:2", "--steps_per_loop=2",
         "--checkpoint_every=2", "--eval_steps=1", "--noexport_saved_model")
ENV = {"PYTHONPATH": None}


def _train(user_dir, model_dir, steps):
  proc = run_script("train.py", *FLAGS, f"--train_steps={steps}",
                    f"--model_dir={model_dir}", env=ENV, cwd=user_dir)
  return proc, re.search(r"final weights sha256=(\w+)", proc.stderr).group(1)


@pytest.mark.slow
def test_a_resumed_mesh_with_dropout_equals_an_uninterrupted_one(tmp_path):
  (tmp_path / "my_dropout.py").write_text(BUILDER)
  _, uninterrupted = _train(tmp_path, tmp_path / "full", 4)
  _train(tmp_path, tmp_path / "resumed", 2)
  proc, resumed = _train(tmp_path, tmp_path / "resumed", 4)
  assert "Restored checkpoint" in proc.stderr
  assert resumed == uninterrupted
