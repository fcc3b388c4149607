"""scripts/configs/*.cfg: every flag file parses into a valid experiment."""

import os

from absl import flags
from absl.testing import flagsaver
import pytest

from scripts import train
from tests.helpers import ROOT

CONFIGS = os.path.join(ROOT, "scripts", "configs")


def _config(name, *extra):
  with flagsaver.flagsaver():
    flags.FLAGS.unparse_flags()
    flags.FLAGS(["train.py", f"--flagfile={os.path.join(CONFIGS, name)}",
                 *extra])
    return train.config_from_flags()


def test_cifar10_reference():
  config = _config("cifar10_reference.cfg")
  assert (config.model, config.dataset, config.strategy) == (
      "cifar_cnn", "cifar10", "mirrored")
  assert (config.global_batch_size, config.epochs) == (1024, 50)
  assert (config.optimizer.name, config.optimizer.learning_rate) == (
      "adam", 1e-3)


def test_unet_and_mlp():
  unet = _config("unet_shapes.cfg")
  assert (unet.model, unet.dataset) == ("unet", "shapes")
  assert unet.dataset_options == {"image_size": 128}
  assert (unet.model_options["depth"], unet.model_options["width"]) == (4, 32)
  mlp = _config("mlp.cfg")
  assert (mlp.model, mlp.model_options["hidden_units"]) == ("mlp", (64, 64))


def test_cifar10_fast_recipe():
  config = _config("cifar10_fast.cfg")
  assert (config.model, config.strategy, config.global_batch_size) == (
      "cifar_cnn", "default", 512)
  assert config.optimizer.nesterov and config.optimizer.schedule == "onecycle"
  assert config.optimizer.scaled(512).learning_rate == pytest.approx(0.1)
  assert (config.label_smoothing, config.ema_decay, config.eval_tta) == (
      0.2, 0.99, "flip")
  assert config.loop.stop_at_accuracy == 0.8079
  assert config.mixed_precision == "auto"


@pytest.mark.parametrize("name", sorted(os.listdir(CONFIGS)))
def test_every_flag_file_parses(name):
  assert _config(name).train_steps or _config(name).epochs
