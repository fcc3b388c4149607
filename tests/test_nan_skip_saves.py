"""`--nan_policy=skip`: a loop with skipped steps (a NaN loss) mean-logs a
NaN loss, yet the weights never took a non-finite update: the run saves its
checkpoints and weights and ends with exit status 0 (it ended in an error
and saved nothing, whatever the policy)."""

import os

from tests.helpers import run_script

NAN_MODEL = '''
import keras
import tensorflow as tf


class NanOnSomeSteps(keras.layers.Layer):
  """NaN outputs on the 2nd and 5th training call (steps 2 and 5)."""

  def build(self, input_shape):
    self.calls = self.add_weight(shape=(), initializer="zeros",
                                 trainable=False, dtype="int32")

  def call(self, x, training=None):
    if not training:
      return x
    self.calls.assign_add(1)
    bad = tf.equal(tf.math.floormod(self.calls, 3), 2)
    return tf.where(bad, tf.fill(tf.shape(x), float("nan")), x)


def build(input_shape, num_classes):
  inputs = keras.Input(input_shape)
  x = keras.layers.Dense(8, activation="relu")(keras.layers.Flatten()(inputs))
  return keras.Model(inputs, keras.layers.Dense(num_classes)(
      NanOnSomeSteps()(x)))
'''


def test_a_run_with_skipped_steps_saves_and_succeeds(tmp_path):
  (tmp_path / "nanmodel.py").write_text(NAN_MODEL)
  model_dir = tmp_path / "run"
  proc = run_script("train.py", "--model=nanmodel:build",
                    "--dataset=synthetic", "--global_batch_size=8",
                    "--train_steps=6", "--nan_policy=skip",
                    f"--model_dir={model_dir}", cwd=str(tmp_path),
                    timeout=300, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "skipped" in proc.stderr
  assert os.path.exists(model_dir / "ckpt-6.index")
  assert os.path.exists(model_dir / "model.weights.h5")
