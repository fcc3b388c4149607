"""model_info.json records the options the builder took, not every model's
flags (`registry.taken_options`), and the dataset options its loader reads
(`data.config.read_options`): no `depth`, `hidden_units`, `num_heads` for
a builder without them, no `image_size` for a numpy dataset."""

import dataclasses
import types

import keras

import framework
from framework.app import export
from framework.data.config import DatasetOptions
from models import registry
from models.options import ModelOptions

ALL_FLAGS = dataclasses.asdict(ModelOptions())  # as train.py passes them


def no_options(input_shape, num_classes):
  return keras.Sequential([keras.Input(input_shape), keras.layers.Flatten(),
                           keras.layers.Dense(num_classes)])


def every_option(input_shape, num_classes, **options):
  del options
  return no_options(input_shape, num_classes)


def _info(model, dataset="numpy", **options):
  config = framework.ExperimentConfig(
      model=model, dataset=dataset, train_steps=1,
      model_options=dict(ALL_FLAGS, **options),
      dataset_options=DatasetOptions().for_dataset(dataset))
  data = types.SimpleNamespace(input_shape=(32, 32, 3), num_classes=10,
                               class_names=[str(i) for i in range(10)])
  return export.model_info(config, data)


def test_model_info_records_only_the_options_the_builder_took():
  here = __name__
  assert _info(f"{here}:no_options")["model_options"] == {}
  assert _info("mlp")["model_options"] == {"hidden_units": [64, 64]}
  assert _info("keras.applications:MobileNetV2", alpha=0.35)[
      "model_options"] == {"alpha": 0.35}
  # A builder that takes **options is passed every one: all are recorded.
  assert set(_info(f"{here}:every_option")["model_options"]) == set(
      ALL_FLAGS)


def test_model_info_records_only_the_dataset_options_read():
  assert _info("mlp", dataset="numpy")["dataset_options"] == {}
  assert _info("mlp", dataset="cifar10")["dataset_options"] == {}
  assert _info("mlp", dataset="shapes")["dataset_options"] == {
      "image_size": 128}


def test_taken_options_of_an_unknown_builder_are_all_of_them():
  assert registry.taken_options("no_such_module:f", {"a": 1}) == {"a": 1}
