"""Models by name, and the seed CNN exactly as published."""

import pytest

import framework
import models


def test_cifar_cnn_has_the_seed_parameter_count():
  model = models.build_model("cifar_cnn", (32, 32, 3), 10)
  assert model.count_params() == 1_676_982
  kinds = [type(layer).__name__ for layer in model.layers]
  assert kinds == ["BatchNormalization", "Conv2D", "Conv2D", "MaxPooling2D",
                   "Dropout", "BatchNormalization", "Conv2D", "Conv2D",
                   "MaxPooling2D", "Dropout", "Flatten", "Dense", "Dropout",
                   "Dense"]


def test_cifar_cnn_options():
  model = models.build_model("cifar_cnn", (32, 32, 3), 10, dropout=False,
                             sync_batch_norm=True)
  assert model.count_params() == 1_676_982
  assert not any(type(l).__name__ == "Dropout" for l in model.layers)
  assert all(l.synchronized for l in model.layers
             if type(l).__name__ == "BatchNormalization")


def test_mlp_hidden_units():
  model = models.build_model("mlp", (4, 4, 3), 10, hidden_units=(8, 6),
                             dropout=True)  # options it does not take: ignored
  assert [l.units for l in model.layers if hasattr(l, "units")] == [8, 6, 10]


def test_unknown_model_lists_the_known_ones():
  with pytest.raises(framework.ConfigError,
                     match=r"model='resnet' is unknown.*cifar_cnn, gpt, mlp"):
    models.build_model("resnet", (32, 32, 3), 10)
