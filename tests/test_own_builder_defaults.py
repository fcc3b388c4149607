"""A builder of one's own keeps its own defaults: only the options the user
set (a flag on the command line or in a flag file, `--model_options`, a
config field set from Python) reach it, and `model_info.json` records what
it was called with, its defaults included."""

import json
import os

import helpers
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


RATE_BUILDER = '''
import keras

def build(input_shape, num_classes, dropout=0.3, **options):
  inputs = keras.Input(input_shape)
  x = keras.layers.Dropout(dropout)(keras.layers.Flatten()(inputs))
  return keras.Model(inputs, keras.layers.Dense(num_classes, **options)(x))
'''


def test_a_built_in_flag_of_another_kind_is_one_line(tmp_path):
  # --dropout is cifar_cnn's bool: a float rate of one's own would get
  # True (a rate of 1: chance) without a word.
  user = tmp_path / "user"
  user.mkdir()
  (user / "rate_nets.py").write_text(RATE_BUILDER)
  model_dir = tmp_path / "run"
  for flag in ("--dropout", "--nodropout"):
    proc = run_script("train.py", "--model=rate_nets:build",
                      "--dataset=synthetic", "--train_steps=1", flag,
                      f"--model_dir={model_dir}", cwd=str(user), check=False)
    helpers.assert_one_line_error(
        proc, "train.py", "model='rate_nets:build' takes dropout as float",
        "--model_options=dropout=VALUE")
    assert not model_dir.exists()


def test_a_kwargs_builder_is_rebuilt_with_only_what_it_took(tmp_path):
  # evaluate.py once added sync_batch_norm=False to every rebuild: a
  # builder passing **options on to a layer got a keyword it never had.
  user = tmp_path / "user"
  user.mkdir()
  (user / "rate_nets.py").write_text(RATE_BUILDER)
  model_dir = tmp_path / "run"
  run_script("train.py", "--model=rate_nets:build", "--dataset=synthetic",
             "--global_batch_size=8", "--train_steps=1",
             "--export_saved_model=false", f"--model_dir={model_dir}",
             cwd=str(user))
  proc = run_script("evaluate.py", f"--model_dir={model_dir}",
                    "--model=rate_nets:build", cwd=str(user), check=False)
  assert proc.returncode == 0, proc.stderr[-2000:]
