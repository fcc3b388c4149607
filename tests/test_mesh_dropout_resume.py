"""A data x pipeline mesh with Dropout resumes exactly: the copies' dropout
seed counters follow copy 0's restored one (they are not checkpointed)."""

import h5py
import numpy as np

from tests import helpers

BUILDER = '''
import keras


def build(input_shape, num_classes):
  inputs = keras.Input(input_shape)
  x = keras.layers.Flatten()(inputs)
  x = keras.layers.Dense(16, activation="relu")(x)
  x = keras.layers.Dropout(0.3)(x)
  x = keras.layers.Dense(16, activation="relu")(x)
  return keras.Model(inputs, keras.layers.Dense(num_classes)(x))
'''

FLAGS = ("--model=dropout_nets:build", "--dataset=synthetic",
         "--global_batch_size=16", "--optimizer=adam", "--eval_steps=1",
         "--cpu_devices=4", "--mesh=data:2,pipeline:2", "--num_microbatches=2")


def _weights(path):
  out = {}
  with h5py.File(path) as f:
    f.visititems(lambda name, obj: out.__setitem__(name, np.array(obj))
                 if isinstance(obj, h5py.Dataset) else None)
  return out


def test_a_resumed_mesh_run_with_dropout_equals_the_uninterrupted_one(
    tmp_path):
  (tmp_path / "dropout_nets.py").write_text(BUILDER)
  helpers.run_script("train.py", *FLAGS, "--train_steps=2",
                     "--model_dir=whole", cwd=tmp_path)
  helpers.run_script("train.py", *FLAGS, "--train_steps=1",
                     "--model_dir=resumed", cwd=tmp_path)
  helpers.run_script("train.py", *FLAGS, "--train_steps=2",
                     "--model_dir=resumed", cwd=tmp_path)
  whole = _weights(tmp_path / "whole" / "model.weights.h5")
  resumed = _weights(tmp_path / "resumed" / "model.weights.h5")
  assert whole.keys() == resumed.keys()
  for key, value in whole.items():
    np.testing.assert_array_equal(resumed[key], value, err_msg=key)
