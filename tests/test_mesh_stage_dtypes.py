"""A data x pipeline mesh whose stages mix variable dtypes (float64,
float16 layers) or train no variable at all (a frozen stage): the copies'
gradients are summed per dtype, and the run equals one device's."""

import h5py
import numpy as np

from tests import helpers

BUILDER = '''
import keras
from keras import ops


class Cast32(keras.layers.Layer):
  def call(self, x):
    return ops.cast(x, "float32")


def build(input_shape, num_classes):
  inputs = keras.Input(input_shape)
  x = keras.layers.Flatten()(inputs)
  frozen = keras.layers.Dense(8, activation="relu", name="frozen")
  frozen.trainable = False
  x = frozen(x)
  x = keras.layers.Dense(8, activation="tanh", dtype="float64")(x)
  x = Cast32()(x)
  x = keras.layers.Dense(8, activation="relu")(x)
  x = keras.layers.Dense(8, activation="relu", dtype="float16")(x)
  x = Cast32()(x)
  return keras.Model(inputs, keras.layers.Dense(num_classes)(x))
'''

FLAGS = ("--model=mixed_nets:build", "--dataset=synthetic", "--train_steps=2",
         "--global_batch_size=16", "--optimizer=adam", "--eval_steps=1")


def _weights(path):
  out = {}
  with h5py.File(path) as f:
    f.visititems(lambda name, obj: out.__setitem__(name, np.array(obj))
                 if isinstance(obj, h5py.Dataset) else None)
  return out


def test_mixed_dtypes_and_a_frozen_stage_on_a_mesh(tmp_path):
  (tmp_path / "mixed_nets.py").write_text(BUILDER)
  helpers.run_script("train.py", *FLAGS, "--model_dir=one", cwd=tmp_path)
  expected = _weights(tmp_path / "one" / "model.weights.h5")
  for name, extra in (
      ("mesh", ()),
      ("zero2", ("--shard_optimizer_state", "--shard_gradients"))):
    for stages in ("3",):
      helpers.run_script(
          "train.py", *FLAGS, "--cpu_devices=" + str(2 * int(stages)),
          f"--mesh=data:2,pipeline:{stages}", "--num_microbatches=2", *extra,
          f"--model_dir={name}{stages}", cwd=tmp_path)
      got = _weights(tmp_path / f"{name}{stages}" / "model.weights.h5")
      assert got.keys() == expected.keys()
      for key, value in expected.items():
        np.testing.assert_allclose(got[key].astype(np.float64), value,
                                   atol=1e-3, err_msg=f"{name}{stages} {key}")


MIXED_STAGE = '''
import keras
from keras import ops


class Cast32(keras.layers.Layer):
  def call(self, x):
    return ops.cast(x, "float32")


def build(input_shape, num_classes):
  inputs = keras.Input(input_shape)
  x = keras.layers.Flatten()(inputs)
  x = keras.layers.Dense(8, activation="tanh", dtype="float64")(x)
  x = Cast32()(x)
  x = keras.layers.Dense(8, activation="relu")(x)
  return keras.Model(inputs, keras.layers.Dense(num_classes)(x))
'''


def test_a_stage_of_float64_and_float32_layers_on_a_mesh(tmp_path):
  (tmp_path / "mixed_stage.py").write_text(MIXED_STAGE)
  flags = ("--model=mixed_stage:build",) + FLAGS[1:]
  helpers.run_script("train.py", *flags, "--model_dir=one", cwd=tmp_path)
  # Stage 0: Flatten, the float64 Dense, the cast, a float32 Dense.
  helpers.run_script("train.py", *flags, "--cpu_devices=4",
                     "--mesh=data:2,pipeline:2", "--stage_boundaries=4",
                     "--model_dir=mesh", cwd=tmp_path)
  expected = _weights(tmp_path / "one" / "model.weights.h5")
  got = _weights(tmp_path / "mesh" / "model.weights.h5")
  assert got.keys() == expected.keys()
  for key, value in expected.items():
    np.testing.assert_allclose(got[key].astype(np.float64), value,
                               atol=1e-4, err_msg=key)
