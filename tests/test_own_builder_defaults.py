"""A builder of one's own keeps its own defaults: only the options the user
set (a flag on the command line or in a flag file, `--model_options`, a
config field set from Python) reach it, and `model_info.json` records what
it was called with, its defaults included."""

import json
import os

from helpers import ROOT, run_script

BUILDER = '''
import json, os
import keras

def build(input_shape, num_classes, num_heads=8, dropout=0.25,
          hidden_units=(5,)):
  with open(os.environ["CALLED_WITH"], "w") as f:
    json.dump({"num_heads": num_heads, "dropout": dropout,
               "hidden_units": list(hidden_units)}, f)
  inputs = keras.Input(input_shape)
  x = keras.layers.Flatten()(inputs)
  x = keras.layers.Dense(hidden_units[0])(x)
  return keras.Model(inputs, keras.layers.Dense(num_classes)(x))
'''


def _train(tmp_path, name, *args):
  user = tmp_path / "user"
  user.mkdir(exist_ok=True)
  (user / "my_builder.py").write_text(BUILDER)
  called = tmp_path / f"{name}.json"
  model_dir = tmp_path / name
  run_script("train.py", "--model=my_builder:build", "--dataset=synthetic",
             "--global_batch_size=8", "--train_steps=1",
             "--export_saved_model=false", f"--model_dir={model_dir}", *args,
             cwd=str(user), env={"CALLED_WITH": str(called)})
  with open(called) as f:
    got = json.load(f)
  with open(model_dir / "model_info.json") as f:
    return got, json.load(f)["model_options"]


def test_no_flag_given_the_builder_keeps_its_own_defaults(tmp_path):
  got, recorded = _train(tmp_path, "defaults")
  want = {"num_heads": 8, "dropout": 0.25, "hidden_units": [5]}
  assert got == want
  assert recorded == want


def test_flags_given_reach_the_builder(tmp_path):
  flagfile = tmp_path / "flags.cfg"
  flagfile.write_text("--hidden_units=7\n")
  got, recorded = _train(tmp_path, "given", "--num_heads=2",
                         "--model_options=dropout=0.5",
                         f"--flagfile={flagfile}")
  want = {"num_heads": 2, "dropout": 0.5, "hidden_units": [7]}
  assert got == want
  assert recorded == want
