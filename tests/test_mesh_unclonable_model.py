"""Copies of a pipeline on a data axis clone the Keras graph: a model
that cannot be cloned (a Lambda of a Python lambda) is one line, and
--model_dir is not created."""

from tests import helpers

BUILDER = '''
import keras


def build(input_shape, num_classes):
  inputs = keras.Input(input_shape)
  x = keras.layers.Flatten()(inputs)
  x = keras.layers.Dense(8, activation="relu")(x)
  x = keras.layers.Lambda(lambda t: t * 2.0)(x)
  return keras.Model(inputs, keras.layers.Dense(num_classes)(x))
'''


def test_an_unclonable_graph_on_a_mesh_is_one_line(tmp_path):
  (tmp_path / "lambda_nets.py").write_text(BUILDER)
  proc = helpers.run_script(
      "train.py", "--model=lambda_nets:build", "--dataset=synthetic",
      "--train_steps=1", "--global_batch_size=16", "--cpu_devices=4",
      "--mesh=data:2,pipeline:2", "--model_dir=run", cwd=tmp_path,
      check=False)
  assert proc.returncode != 0
  lines = [line for line in proc.stderr.splitlines()
           if line.startswith("train.py: error:")]
  assert len(lines) == 1, proc.stderr[-3000:]
  assert "Lambda" in lines[0] and "clon" in lines[0], lines[0]
  assert "Traceback" not in proc.stderr
  assert not (tmp_path / "run").exists()
