"""A model function is checked before training, and a run directory's
model_info.json runs no code unless the user names or trusts it."""

import json
import logging
import os
import sys

import pytest

import framework
from framework import ExperimentConfig
from framework.app import export, experiment
from helpers import assert_one_line_error, run_script, snapshot

BAD_NETS = '''
import keras

def no_classes(input_shape):
  raise AssertionError("called with the wrong arguments")

def returns_none(input_shape, num_classes):
  return None

def three_logits(input_shape, num_classes):
  return keras.Sequential([keras.Input(input_shape), keras.layers.Flatten(),
                           keras.layers.Dense(3)])
'''

# Importing this module writes MARKER: the code a run directory names.
EVIL_NET = '''
import os
open(os.environ["DISTLOOP_TEST_MARKER"], "w").write("imported")
from models.mlp import build
'''


def _config(model_dir, model):
  return ExperimentConfig(model=model, dataset="synthetic",
                          model_dir=str(model_dir), global_batch_size=32,
                          train_steps=2, export_saved_model=False,
                          model_options=dict(hidden_units=(8,)))


@pytest.mark.parametrize("model,fragments", [
    ("bad_nets:no_classes", ["no_classes(input_shape)", "cannot be called"]),
    ("bad_nets:returns_none", ["returned None, not a keras.Model"]),
    ("bad_nets:three_logits", ["outputs 3 logits", "has 10 classes"]),
    ("os:getcwd", ["getcwd()", "cannot be called"]),
])
def test_bad_model_function_is_named_before_anything_is_written(
    tmp_path, monkeypatch, model, fragments):
  (tmp_path / "bad_nets.py").write_text(BAD_NETS)
  monkeypatch.syspath_prepend(str(tmp_path))
  model_dir = tmp_path / "run"
  with pytest.raises(framework.ConfigError) as error:
    experiment.run(_config(model_dir, model))
  message = str(error.value)
  assert message.startswith(f"model={model!r}"), message
  for fragment in fragments:
    assert fragment in message, message
  assert not model_dir.exists()


def test_os_getcwd_is_one_line(tmp_path):
  before = snapshot(tmp_path)
  proc = run_script("train.py", "--model=os:getcwd", "--dataset=synthetic",
                    "--train_steps=2", f"--model_dir={tmp_path / 'run'}",
                    check=False)
  assert_one_line_error(proc, "train.py", "model='os:getcwd'",
                        unchanged=before)


def build_in_main(input_shape, num_classes):
  from models import mlp  # pylint: disable=g-import-not-at-top
  return mlp.build(input_shape, num_classes, hidden_units=(8,))


def test_a_build_in_main_warns_what_evaluate_will_need(
    tmp_path, monkeypatch, caplog):
  main = sys.modules["__main__"]
  monkeypatch.setattr(build_in_main, "__module__", "__main__")
  monkeypatch.setattr(main, "build_in_main", build_in_main, raising=False)
  monkeypatch.setattr(main, "__file__", str(tmp_path / "my_train.py"),
                      raising=False)
  caplog.set_level(logging.WARNING)
  experiment.run(_config(tmp_path / "run", "mlp"), build_model=build_in_main)
  assert "__main__:build_in_main is defined in __main__" in caplog.text
  assert "--model=my_train:build_in_main" in caplog.text


@pytest.fixture
def evil(tmp_path, monkeypatch):
  """A finished run whose model_info.json was edited to name EVIL_NET."""
  code_dir = tmp_path / "downloaded"
  code_dir.mkdir()
  (code_dir / "evil_net.py").write_text(EVIL_NET)
  marker = tmp_path / "marker"
  monkeypatch.setenv("DISTLOOP_TEST_MARKER", str(marker))
  model_dir = tmp_path / "run"
  experiment.run(_config(model_dir, "mlp"))
  path = model_dir / "model_info.json"
  info = json.loads(path.read_text())
  info.update(model="evil_net:build", model_import_dir=str(code_dir))
  path.write_text(json.dumps(info))
  return dict(model_dir=str(model_dir), marker=marker, info=info)


def test_model_info_code_is_not_imported_unless_trusted(evil):
  with pytest.raises(framework.ConfigError, match="--trust_model_code"):
    export.build_inference_model(evil["info"])
  assert not evil["marker"].exists() and "evil_net" not in sys.modules
  try:
    export.build_inference_model(evil["info"], trust_model_code=True)
    assert evil["marker"].exists()
  finally:
    sys.modules.pop("evil_net", None)


@pytest.mark.slow
def test_evaluate_and_predict_import_nothing_by_default(evil, tmp_path):
  image = tmp_path / "image.png"
  from PIL import Image  # pylint: disable=g-import-not-at-top
  Image.new("RGB", (32, 32)).save(image)
  for script, args in (("evaluate.py", []),
                       ("predict.py", [f"--image={image}"])):
    proc = run_script(script, f"--model_dir={evil['model_dir']}", *args,
                      check=False)
    line = assert_one_line_error(proc, script, "evil_net:build",
                                 "--trust_model_code", "your own copy")
    # Naming the run's function again would not import the run's code, but
    # the line must not suggest that this makes the run's code safe.
    assert "--model=evil_net:build" not in line
    assert not evil["marker"].exists()


# A module that writes `marker` when imported and builds the mlp.
MARKING_NET = """
open({marker!r}, "w").write("imported")
from models.mlp import build as plain
"""


@pytest.fixture
def shadowed(tmp_path, monkeypatch):
  """A downloaded run whose model_info.json names `user_nets:plain` in a
  folder inside the run, and a user's project folder, the current one,
  with a `user_nets.py` of their own (neither folder on sys.path)."""
  model_dir = tmp_path / "run"
  experiment.run(_config(model_dir, "mlp"))
  runs_code = model_dir / "code"
  runs_code.mkdir()
  (runs_code / "user_nets.py").write_text(
      MARKING_NET.format(marker=str(tmp_path / "run_marker")))
  project = tmp_path / "project"
  project.mkdir()
  (project / "user_nets.py").write_text(
      MARKING_NET.format(marker=str(tmp_path / "user_marker")))
  path = model_dir / "model_info.json"
  info = json.loads(path.read_text())
  info.update(model="user_nets:plain", model_import_dir=str(runs_code))
  path.write_text(json.dumps(info))
  monkeypatch.chdir(project)
  monkeypatch.setattr(sys, "path", list(sys.path))
  yield dict(model_dir=str(model_dir), info=info, project=str(project),
             run_marker=tmp_path / "run_marker",
             user_marker=tmp_path / "user_marker")
  sys.modules.pop("user_nets", None)


def test_a_named_model_is_the_users_own_code_never_the_runs(shadowed):
  info = export.with_model(shadowed["info"], "user_nets:plain")
  export.build_inference_model(info)
  assert not shadowed["run_marker"].exists()
  assert shadowed["user_marker"].exists()
  assert sys.modules["user_nets"].__file__ == os.path.join(
      shadowed["project"], "user_nets.py")


def test_only_trust_imports_from_the_runs_recorded_folder(shadowed):
  os.chdir(os.path.dirname(shadowed["project"]))  # no user_nets.py here
  with pytest.raises(framework.ConfigError, match="no module named"):
    export.build_inference_model(
        export.with_model(shadowed["info"], "user_nets:plain"))
  assert not shadowed["run_marker"].exists()
  export.build_inference_model(shadowed["info"], trust_model_code=True)
  assert shadowed["run_marker"].exists()


@pytest.mark.slow
def test_evaluate_with_model_imports_the_users_module(shadowed):
  proc = run_script("evaluate.py", f"--model_dir={shadowed['model_dir']}",
                    "--model=user_nets:plain", cwd=shadowed["project"])
  assert "accuracy" in proc.stdout
  assert not shadowed["run_marker"].exists()
  assert shadowed["user_marker"].exists()
