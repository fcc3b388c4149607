"""A model whose weights carry a Keras constraint (kernel_constraint=...)
is refused in one line: the step's update is distloop's own, which does
not apply constraints as Keras's `optimizer.apply` does, so the run would
otherwise train without them silently (other weights than Keras's)."""

import os
import textwrap

import keras
import pytest
import tensorflow as tf

from framework.core.trainer import Trainer
from framework.errors import ConfigError
from tests import helpers


def _model(constraint):
  inputs = keras.Input((4,))
  x = keras.layers.Dense(3, name="hidden", kernel_constraint=constraint)(inputs)
  return keras.Model(inputs, keras.layers.Dense(2, name="out")(x))


def test_trainer_refuses_a_constrained_weight_naming_it():
  with pytest.raises(ConfigError, match=r"hidden/kernel.*UnitNorm"):
    Trainer(_model(keras.constraints.UnitNorm()), keras.optimizers.SGD(),
            tf.distribute.get_strategy(), global_batch_size=8)


def test_an_unconstrained_model_builds():
  Trainer(_model(None), keras.optimizers.SGD(), tf.distribute.get_strategy(),
          global_batch_size=8)


def test_zero3_mesh_run_is_one_line_and_writes_nothing(tmp_path):
  (tmp_path / "constrained.py").write_text(textwrap.dedent("""\
      import keras
      def build(input_shape, num_classes):
        inputs = keras.Input(input_shape)
        x = keras.layers.Flatten()(inputs)
        x = keras.layers.Dense(8, kernel_constraint=keras.constraints.NonNeg(),
                               name="hidden")(x)
        return keras.Model(inputs, keras.layers.Dense(num_classes)(x))
      """))
  model_dir = tmp_path / "run"
  before = helpers.snapshot(str(model_dir))
  proc = helpers.run_script(
      "train.py", "--model=constrained:build", "--dataset=synthetic",
      "--cpu_devices=4", "--mesh=data:2,pipeline:2", "--num_microbatches=2",
      "--shard_optimizer_state", "--shard_gradients", "--shard_parameters",
      "--global_batch_size=16", "--train_steps=2", "--noexport_saved_model",
      f"--model_dir={model_dir}", check=False, cwd=str(tmp_path),
      env={"PYTHONPATH": str(tmp_path) + os.pathsep + helpers.ROOT})
  helpers.assert_one_line_error(proc, "train.py", "hidden/kernel", "NonNeg",
                                unchanged=before)
