"""`--model=keras.applications:NAME` (and any builder of the keyword form
`input_shape=, classes=`): built by keyword for the dataset's shape and
classes, random weights unless a local file is named, logits out; trained a
couple of steps on one device and on `mirrored`; bad names, weights files
and signatures are one line before anything is written."""

import dataclasses
import json

import keras
import numpy as np
import pytest

import framework
from framework.app import experiment
from models import registry
from models.options import ModelOptions
from helpers import assert_one_line_error, run_script, snapshot
from shared_strategy import mirrored

APPLICATIONS = ("MobileNetV2", "ResNet50", "EfficientNetB0")
BUILTIN_OPTIONS = dataclasses.asdict(ModelOptions())


@pytest.mark.parametrize("name", APPLICATIONS)
def test_application_is_built_by_keyword_with_logits(name):
  # The built-in models' flags (hidden_units, depth, ...) come along as in
  # a train.py run; the keyword form takes only the options it names.
  model = registry.build_model(f"keras.applications:{name}", (32, 32, 3), 10,
                               **BUILTIN_OPTIONS)
  assert model.input_shape == (None, 32, 32, 3)
  assert model.output_shape == (None, 10)
  if isinstance(model.layers[-1], keras.Model):  # EfficientNet: given pixels
    model = model.layers[-1]
  assert model.layers[-1].activation is keras.activations.linear  # logits


def _config(tmp_path, name, strategy):
  return framework.ExperimentConfig(
      dataset="synthetic", model=f"keras.applications:{name}",
      model_dir=str(tmp_path), strategy=strategy, global_batch_size=4,
      train_steps=2, export_saved_model=False,
      loop=framework.LoopConfig(train_steps=2, steps_per_loop=2,
                                eval_steps=1))


# Trained here: MobileNetV2 on one device and EfficientNetB0 (the Rescaling
# and Normalization it builds in) on mirrored, each model and each strategy
# once: the other two pairs took the same path (a keyword builder, then
# experiment.run) and cost 35-65 s. ResNet50 takes it too and trains by name
# on one device and on mirrored in test_keras_ports.py
# (keras_ports_vs_fit.py's distloop runs, resnet50_cifar10.py): a third
# copy here cost ~40 s.
TRAINED = (pytest.param("MobileNetV2", "default"),
           pytest.param("EfficientNetB0", "mirrored",
                        marks=pytest.mark.slow))


@pytest.mark.parametrize("name,strategy", TRAINED)
def test_application_trains_on_one_device_and_mirrored(tmp_path, name,
                                                       strategy):
  config = _config(tmp_path, name, strategy)
  results = experiment.run(
      config, strategy=mirrored() if strategy == "mirrored" else None)
  assert np.isfinite(results["loss"])
  assert (tmp_path / "ckpt-2.index").exists()
  with open(tmp_path / "model_info.json") as f:
    assert json.load(f)["model"] == f"keras.applications:{name}"


def test_weights_option_loads_a_local_file(tmp_path):
  name = "keras.applications:MobileNetV2"
  first = registry.build_model(name, (32, 32, 3), 10, alpha=0.35)
  path = str(tmp_path / "start.weights.h5")
  first.save_weights(path)
  keras.utils.set_random_seed(1)  # another random start: the file decides
  second = registry.build_model(name, (32, 32, 3), 10, alpha=0.35,
                                weights=path)
  for a, b in zip(first.weights, second.weights):
    np.testing.assert_array_equal(a.numpy(), b.numpy())
  options = registry.parse_options(name, f"alpha=0.35,weights={path}")
  assert options == {"alpha": 0.35, "weights": path}


@pytest.mark.parametrize("args,message", [
    (["--model=keras.applications:ResNet5"],
     "module keras.applications has no attribute 'ResNet5'; did you mean "
     "ResNet50"),
    (["--model=keras.applications:ResNet50",
      "--model_options=weights=/no/such/file.weights.h5"],
     "weights='/no/such/file.weights.h5' is not a local file"),
])
def test_bad_name_or_weights_is_one_line_and_writes_nothing(tmp_path, args,
                                                            message):
  model_dir = tmp_path / "run"
  proc = run_script("train.py", "--dataset=synthetic", "--train_steps=1",
                    f"--model_dir={model_dir}", *args, check=False)
  assert proc.returncode == 1, proc.stderr[-2000:]
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith("train.py: error: model=") and message in last, (
      proc.stderr[-2000:])
  assert "Traceback" not in proc.stderr
  assert not model_dir.exists()


def _shape_only(include_top=True, weights=None, input_shape=None):
  del include_top, weights, input_shape


def test_builder_of_neither_form_is_refused_in_one_line():
  with pytest.raises(framework.ConfigError) as e:
    registry.call_builder(_shape_only, (32, 32, 3), 10, {}, name="m:f")
  message = str(e.value)
  assert "\n" not in message
  assert "_shape_only(include_top=True, weights=None, input_shape=None)" in (
      message)
  assert "build(input_shape, num_classes, **options) or keywords " in message


def test_positional_builders_are_called_as_before():
  calls = []

  def build(shape, n, **options):
    calls.append((shape, n, sorted(options)))
    return keras.Sequential([keras.Input(shape), keras.layers.Flatten(),
                             keras.layers.Dense(n)])

  registry.call_builder(build, (4, 4, 1), 3, {"depth": 2}, name="m:build")
  assert calls == [((4, 4, 1), 3, ["depth"])]


def _garbage_weights(folder):
  """{kind: path} of files that are no Keras weights file for MobileNetV2
  (alpha=0.35, 10 classes)."""
  model = registry.build_model("keras.applications:MobileNetV2", (32, 32, 3),
                               5, alpha=0.35)  # another head: does not fit
  other = str(folder / "five_classes.weights.h5")
  model.save_weights(other)
  with open(other, "rb") as f:
    data = f.read()
  model.save(str(folder / "whole.keras"))
  with open(folder / "whole.keras", "rb") as f:
    archive = f.read()
  files = {"random.weights.h5": np.random.default_rng(0).bytes(4096),
           "notes.txt": b"not weights\n",
           "truncated.weights.h5": data[:len(data) // 2],
           "truncated.h5": data[:len(data) // 2],
           "truncated.keras": archive[:len(archive) // 2]}
  for name, content in files.items():
    (folder / name).write_bytes(content)
  return {name: str(folder / name) for name in [*files,
                                                "five_classes.weights.h5"]}


def test_garbage_weights_file_is_one_line_naming_it(tmp_path):
  files = _garbage_weights(tmp_path)
  model_dir = tmp_path / "run"
  model_dir.mkdir()
  before = snapshot(str(model_dir))
  for name, path in files.items():
    proc = run_script("train.py", "--dataset=synthetic", "--train_steps=1",
                      f"--model_dir={model_dir}",
                      "--model=keras.applications:MobileNetV2",
                      f"--model_options=alpha=0.35,weights={path}",
                      check=False)
    expected = ("does not fit the model" if name.startswith("five")
                else "is not a Keras weights file")
    line = assert_one_line_error(proc, "train.py", f"weights={path!r}",
                                 expected, ".weights.h5", unchanged=before)
    assert "Traceback" not in proc.stderr, (name, line)


@pytest.mark.parametrize("args,message", [
    (["--model=keras.applications:ResNet50.__class__"],
     "attributes starting with '_' are refused"),
    (["--model=keras.applications:_private"],
     "attributes starting with '_' are refused"),
    (["--model=keras.applications:MobileNetV2",
      "--model_options=classifier_activation=softmax"],
     "classifier_activation='softmax' is not supported: distloop's losses "
     "take logits; use classifier_activation=None"),
])
def test_private_path_or_softmax_is_one_line(tmp_path, args, message):
  model_dir = tmp_path / "run"
  before = snapshot(str(model_dir))
  proc = run_script("train.py", "--dataset=synthetic", "--train_steps=1",
                    f"--model_dir={model_dir}", *args, check=False)
  assert_one_line_error(proc, "train.py", message, unchanged=before)


def _softmax_head(input_shape=None, classes=10):
  return keras.Sequential([keras.Input(input_shape), keras.layers.Flatten(),
                           keras.layers.Dense(classes, activation="softmax")])


def test_final_softmax_layer_is_refused():
  with pytest.raises(framework.ConfigError, match="applies softmax"):
    registry.call_builder(_softmax_head, (4, 4, 1), 3, {}, name="m:f")


def test_classifier_activation_none_or_linear_gives_logits():
  for value in ("None", "linear"):
    options = registry.parse_options("keras.applications:MobileNetV2",
                                     f"alpha=0.35,classifier_activation={value}")
    model = registry.build_model("keras.applications:MobileNetV2",
                                 (32, 32, 3), 10, **options)
    assert model.layers[-1].activation is keras.activations.linear
