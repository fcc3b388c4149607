"""scripts/configs/*.cfg and the flag -> ExperimentConfig path.

Every flag a flag file sets must reach the field of the ExperimentConfig
that uses it (a mis-wired `config_from_flags` fails here), the recipes must
mean what their comments say (steps per epoch, warm-up length, schedules),
and bad values must be rejected with a message naming the argument.
"""

import os
import types

from absl import flags
from absl.testing import flagsaver
import pytest
import tensorflow as tf

from framework.app import experiment
from framework.core.controller import LoopConfig
from framework.errors import ConfigError
from framework.app.experiment import ExperimentConfig
from scripts import train
from tests.helpers import ROOT, run_script

CONFIGS = os.path.join(ROOT, "scripts", "configs")
CIFAR10_TRAIN = 50000
CIFAR10_STEPS_PER_EPOCH = 48  # 50000 // 1024, the last partial batch dropped

# Where each flag the flag files set ends up in the ExperimentConfig.
FIELDS = {
    "model": "model", "dataset": "dataset", "strategy": "strategy",
    "global_batch_size": "global_batch_size", "epochs": "epochs",
    "train_steps": "train_steps", "seed": "seed", "augment": "augment",
    "optimizer": "optimizer.name", "learning_rate": "optimizer.learning_rate",
    "weight_decay": "optimizer.weight_decay",
    "lr_schedule": "optimizer.schedule",
    "warmup_steps": "optimizer.warmup_steps",
    "steps_per_loop": "loop.steps_per_loop",
    "checkpoint_every": "loop.checkpoint_every",
    "eval_every": "loop.eval_every", "summary_every": "loop.summary_every",
    "log_every": "loop.log_every",
    "momentum": "optimizer.momentum",
    "keep_checkpoints": "loop.keep_checkpoints",
    "grad_accum_steps": "grad_accum_steps",
    "hidden_units": "model_options.hidden_units",
    "unet_depth": "model_options.depth", "unet_width": "model_options.width",
    "image_size": "dataset_options.image_size",
    "mixed_precision": "mixed_precision", "nesterov": "optimizer.nesterov",
    "lr_scaling": "optimizer.lr_scaling",
    "lr_base_batch_size": "optimizer.base_batch_size",
    "label_smoothing": "label_smoothing", "ema_decay": "ema_decay",
    "ema_warmup": "ema_warmup", "eval_tta": "eval_tta",
    "stop_at_accuracy": "loop.stop_at_accuracy",
    "eval_start_step": "loop.eval_start_step",
    # Not part of the config (it configures devices before TensorFlow starts);
    # recorded with the run's flags.
    "cpu_devices": "hparams.cpu_devices",
    "onednn": "hparams.onednn",  # sets TF_ENABLE_ONEDNN_OPTS, as above
}


def _config(*args):
  with flagsaver.flagsaver():
    flags.FLAGS.unparse_flags()
    flags.FLAGS(["train.py", *args])
    return train.config_from_flags()


def _file(name, *extra):
  return _config(f"--flagfile={os.path.join(CONFIGS, name)}", *extra)


def _field(config, path):
  value = config
  for part in path.split("."):
    value = value[part] if isinstance(value, dict) else getattr(value, part)
  return value


def _flag_file_values(name):
  """{flag: parsed value} of the --flag=value lines of a flag file."""
  values = {}
  for line in open(os.path.join(CONFIGS, name)):
    line = line.strip()
    if line and not line.startswith("#"):
      flag, _, raw = line[2:].partition("=")
      if not raw and flag not in flags.FLAGS:  # --noflag
        flag, raw = flag[2:], "false"
      values[flag] = flags.FLAGS[flag].parser.parse(raw or "true")
  return values


def test_cifar10_fast_recipe():
  config = _file("cifar10_fast.cfg")
  assert (config.model, config.strategy, config.global_batch_size) == (
      "cifar_cnn", "default", 512)
  assert config.optimizer.nesterov and config.optimizer.schedule == "onecycle"
  assert config.optimizer.scaled(512).learning_rate == pytest.approx(0.1)
  assert (config.label_smoothing, config.ema_decay, config.eval_tta) == (
      0.0, 0.99, "flip")
  assert config.augment == "flip" and config.epochs == 15
  # Evaluations after every epoch from epoch 8 on (97 steps per epoch).
  assert (config.loop.eval_every, config.loop.eval_start_step) == (97, 776)
  assert config.loop.stop_at_accuracy == 0.8079
  assert config.mixed_precision == "auto"
  assert config.hparams["onednn"] == "on"


@pytest.mark.parametrize("name", sorted(os.listdir(CONFIGS)))
def test_every_flag_of_a_flag_file_reaches_its_config_field(name):
  config = _file(name)
  values = _flag_file_values(name)
  assert values, f"{name} sets no flags"
  for flag, value in values.items():
    assert flag in FIELDS, f"{name}: --{flag} is not mapped in FIELDS"
    # Recorded as the run's flags (TensorBoard's text summary).
    assert config.hparams[flag] == value, flag
    got = _field(config, FIELDS[flag])
    if flag == "hidden_units":
      value = tuple(int(v) for v in value)
    assert got == value, f"{name}: --{flag}={value!r} gave {got!r}"


def test_each_numeric_flag_reaches_its_own_field():
  # Distinct values, so that two swapped fields cannot go unnoticed (the
  # flag files often give related flags equal values).
  values = {"train_steps": 101, "steps_per_loop": 3, "checkpoint_every": 5,
            "eval_every": 7, "summary_every": 11, "log_every": 13,
            "keep_checkpoints": 2, "warmup_steps": 17, "seed": 31,
            "global_batch_size": 36, "grad_accum_steps": 4, "unet_depth": 2,
            "unet_width": 41, "image_size": 43, "learning_rate": 0.19,
            "weight_decay": 0.23, "momentum": 0.29}
  config = _config(*[f"--{k}={v}" for k, v in values.items()])
  assert {k: _field(config, FIELDS[k]) for k in values} == values


def _optimizer_and_loop(config):
  """What `experiment.build_model_and_optimizer` makes of `config` for
  CIFAR-10's 50000 training images (the images themselves are not needed)."""
  dataset = types.SimpleNamespace(num_train_examples=CIFAR10_TRAIN,
                                  input_shape=(32, 32, 3), num_classes=10,
                                  label_shape=())
  _, optimizer, loop = experiment.build_model_and_optimizer(
      config, tf.distribute.get_strategy(), dataset)
  return optimizer, loop


def _learning_rate(optimizer, step):
  schedule = optimizer._learning_rate  # pylint: disable=protected-access
  if callable(schedule):
    return float(schedule(step))
  return float(schedule.numpy())


def test_cifar10_recipe_warms_up_5_epochs_then_decays_to_0_at_epoch_50():
  config = _file("cifar10_recipe.cfg")
  optimizer, loop = _optimizer_and_loop(config)
  total = 50 * CIFAR10_STEPS_PER_EPOCH
  assert loop.train_steps == total == 2400
  assert config.optimizer.warmup_steps == 5 * CIFAR10_STEPS_PER_EPOCH
  assert loop.checkpoint_every == 10 * CIFAR10_STEPS_PER_EPOCH
  assert loop.eval_every == CIFAR10_STEPS_PER_EPOCH  # once per epoch
  assert type(optimizer).__name__ == "AdamW"
  assert float(optimizer.weight_decay) == pytest.approx(0.05)
  assert _learning_rate(optimizer, 0) < 0.003 / 100
  assert _learning_rate(optimizer, 240) == pytest.approx(0.003, rel=1e-3)
  assert _learning_rate(optimizer, 1320) < _learning_rate(optimizer, 240)
  assert _learning_rate(optimizer, total) == pytest.approx(0, abs=1e-7)


def test_cifar10_reference_is_adam_at_a_constant_1e3_for_50_epochs():
  config = _file("cifar10_reference.cfg")
  optimizer, loop = _optimizer_and_loop(config)
  assert loop.train_steps == 50 * CIFAR10_STEPS_PER_EPOCH
  assert type(optimizer).__name__ == "Adam"
  for step in (0, 1000, 2400):
    assert _learning_rate(optimizer, step) == pytest.approx(1e-3)
  assert config.augment == "none" and config.global_batch_size == 1024


def test_a_length_in_a_flag_file_is_replaced_by_unsetting_it_with_0():
  config = _file("cifar10_reference.cfg", "--epochs=0", "--train_steps=20",
                 "--strategy=default")
  assert (config.train_steps, config.epochs, config.strategy) == (
      20, None, "default")
  with pytest.raises(ConfigError, match=r"set exactly one of train_steps and "
                     r"epochs \(got train_steps=20, epochs=50\)"):
    _file("cifar10_reference.cfg", "--train_steps=20")


BAD_FLAGS = {
    "batch_0": (["--train_steps=1", "--global_batch_size=0"],
                "--global_batch_size must be a positive integer"),
    "steps_per_loop_0": (["--train_steps=1", "--steps_per_loop=0"],
                         "--steps_per_loop must be a positive integer"),
    "negative_length": (["--train_steps=-3"], "--train_steps must be >= 0"),
    "hidden_units_not_int": (["--train_steps=1", "--hidden_units=64,x"],
                             "--hidden_units must be integers separated"),
    "negative_interval": (["--train_steps=1", "--checkpoint_every=-1"],
                          "--checkpoint_every must be >= 0"),
    "no_length": ([], "set exactly one of train_steps and epochs (got "
                      "train_steps=None, epochs=None)"),
    "learning_rate_0": (["--train_steps=1", "--learning_rate=0"],
                        "learning_rate=0.0 must be > 0"),
    "step_schedule_without_boundaries": (
        ["--train_steps=1", "--lr_schedule=step"],
        "lr_schedule=step needs lr_step_boundaries"),
    "boundaries_not_increasing": (
        ["--train_steps=1", "--lr_schedule=step",
         "--lr_step_boundaries=800,500"],
        "lr_step_boundaries=[800, 500] must be strictly increasing"),
}


@pytest.mark.parametrize("case", sorted(BAD_FLAGS))
def test_bad_flags_are_rejected_naming_the_flag(case):
  args, message = BAD_FLAGS[case]
  with pytest.raises((ConfigError, flags.Error)) as error:
    _config(*args)
  assert message in str(error.value)


BAD_CONFIGS = {
    "global_batch_size": (dict(global_batch_size=0),
                          "global_batch_size=0 must be a positive integer"),
    "epochs": (dict(train_steps=None, epochs=-1),
               "epochs=-1 must be a positive integer"),
    "grad_accum_steps": (dict(grad_accum_steps=2.5),
                         "grad_accum_steps=2.5 must be a positive integer"),
    "input_mode": (dict(input_mode="host"),
                   "input_mode='host' is not valid; choose one of: global, "
                   "per_replica"),
    "mixed_precision": (dict(mixed_precision="fp8"),
                        "mixed_precision='fp8' is not valid"),
    "augment": (dict(augment="mixup"),
                "augment='mixup' is not valid; choose one of: none, flip, "
                "crop_flip"),
}


@pytest.mark.parametrize("field", sorted(BAD_CONFIGS))
def test_bad_config_values_are_rejected_naming_the_argument(field):
  kwargs, message = BAD_CONFIGS[field]
  with pytest.raises(ConfigError) as error:
    ExperimentConfig(**dict(dict(train_steps=10), **kwargs))
  assert message in str(error.value)


@pytest.mark.parametrize("kwargs,message", [
    (dict(steps_per_loop=0), "steps_per_loop=0 must be a positive integer"),
    (dict(summary_every=-5), "summary_every=-5 must be an integer >= 0"),
    (dict(keep_checkpoints=0), "keep_checkpoints=0 must be a positive"),
])
def test_bad_loop_values_are_rejected_naming_the_argument(kwargs, message):
  with pytest.raises(ConfigError) as error:
    LoopConfig(train_steps=10, **kwargs)
  assert message in str(error.value)


def test_a_bad_value_after_a_flag_file_is_one_line_and_writes_nothing(
    tmp_path):
  model_dir = tmp_path / "run"
  proc = run_script("train.py", f"--flagfile={CONFIGS}/mlp.cfg",
                    "--learning_rate=-1", f"--model_dir={model_dir}",
                    check=False)
  assert proc.returncode == 1, proc.stderr[-3000:]
  assert [l for l in proc.stderr.splitlines() if ": error: " in l] == [
      "train.py: error: learning_rate=-1.0 must be > 0"]
  assert "Traceback" not in proc.stderr
  assert not model_dir.exists()
