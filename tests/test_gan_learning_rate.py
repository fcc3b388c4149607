"""The GAN port's --generator_learning_rate on a resume: the flag is
applied over the checkpoint's rate (as --learning_rate is for the
discriminator), in one logged line."""

import os

import numpy as np
import tensorflow as tf

import helpers
from helpers import ROOT


def _gan(model_dir, *args):
  proc = helpers.run_python(
      os.path.join(ROOT, "scripts", "examples", "gan.py"), "--model=mlp",
      "--hidden_units=8", "--dataset=synthetic", "--global_batch_size=16",
      "--steps_per_loop=2", "--eval_steps=1", "--export_saved_model=false",
      f"--model_dir={model_dir}", *args)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc.stderr


def _generator_rate(prefix):
  reader = tf.train.load_checkpoint(str(prefix))
  keys = [k for k in reader.get_variable_to_shape_map()
          if "generator_optimizer" in k and "learning_rate" in k]
  assert len(keys) == 1, keys
  return float(reader.get_tensor(keys[0]))


def test_resume_applies_the_generator_learning_rate_flag(tmp_path):
  stderr = _gan(tmp_path, "--train_steps=2")
  assert "replaces the checkpoint's" not in stderr
  np.testing.assert_allclose(_generator_rate(tmp_path / "ckpt-2"), 1e-3,
                             rtol=1e-6)
  stderr = _gan(tmp_path, "--train_steps=4", "--generator_learning_rate=5e-4")
  assert "generator_learning_rate=0.0005 replaces the checkpoint's 0.001" in (
      stderr), stderr[-3000:]
  np.testing.assert_allclose(_generator_rate(tmp_path / "ckpt-4"), 5e-4,
                             rtol=1e-6)
