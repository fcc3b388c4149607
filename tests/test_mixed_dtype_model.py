"""A model whose layers compute in several dtypes (a float16 and a float64
Dense beside float32 ones) trains end to end: the gradient's global norm
(clipping, the NaN skip, the spike signals) is measured in float32 where
the gradients' dtypes differ, instead of failing in TensorFlow's stack."""

import numpy as np
import tensorflow as tf

import helpers
from framework.core import updates

BUILDER = '''
import keras


def build(input_shape, num_classes):
  inputs = keras.Input(input_shape)
  x = keras.layers.Flatten()(inputs)
  x = keras.layers.Dense(5, activation="relu", dtype="float16")(x)
  x = keras.layers.Dense(3, dtype="float64")(x)
  return keras.Model(inputs, keras.layers.Dense(num_classes, dtype="float32")(x))
'''


def test_global_norm_of_several_dtypes_is_the_float32_norm():
  tensors = [tf.constant([3.0], tf.float16), tf.constant([4.0], tf.float64),
             tf.constant([12.0], tf.float32)]
  np.testing.assert_allclose(updates.global_norm(tensors).numpy(), 13.0)
  same = [tf.constant([3.0]), tf.constant([4.0])]
  assert updates.global_norm(same).numpy() == tf.linalg.global_norm(
      same).numpy()


def test_a_model_of_several_dtypes_trains_on_2_replicas(tmp_path):
  (tmp_path / "mixed_dtypes.py").write_text(BUILDER)
  proc = helpers.run_script(
      "train.py", "--model=mixed_dtypes:build", "--dataset=synthetic",
      "--train_steps=3", "--global_batch_size=12", "--strategy=mirrored",
      "--cpu_devices=2", "--grad_accum_steps=2", "--clip_norm=1",
      "--optimizer=adam", f"--model_dir={tmp_path / 'run'}",
      env={"PYTHONPATH": f"{tmp_path}:{helpers.ROOT}"}, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert (tmp_path / "run" / "ckpt-3.index").exists()
