"""scripts/configs/*.cfg and the flag -> ExperimentConfig path.

Every flag a flag file sets must reach the field of the ExperimentConfig
that uses it (a mis-wired `config_from_flags` fails here), the recipes must
mean what their comments say (steps per epoch, warm-up length, schedules),
and bad values must be rejected with a message naming the argument.
"""

import ast
import dataclasses
import json
import os
import sys
import types
import typing

from absl import flags
from absl.testing import flagsaver
import pytest
import tensorflow as tf

from framework import settings
from framework.app import config as app_config
from framework.app import experiment, factory
from framework.core.controller import LoopConfig
from framework.core.optimizers import OptimizerConfig
from framework.errors import ConfigError
from framework.app.config import ExperimentConfig
from scripts import cli, config_flags, train
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
    "sync_batch_norm": "model_options.sync_batch_norm",
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
    # Recorded as the run's settings (TensorBoard) unless at the default.
    assert config.hparams.get(flag, flags.FLAGS[flag].default) == value, flag
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
  _, optimizer, loop = factory.build_model_and_optimizer(
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
                "global_batch_size=0 must be a positive integer"),
    "steps_per_loop_0": (["--train_steps=1", "--steps_per_loop=0"],
                         "steps_per_loop=0 must be a positive integer"),
    "negative_length": (["--train_steps=-3"],
                        "train_steps=-3 must be a positive integer"),
    "hidden_units_not_int": (["--train_steps=1", "--hidden_units=64,x"],
                             "hidden_units='64,x' must be integers "
                             "separated by commas"),
    "negative_interval": (["--train_steps=1", "--checkpoint_every=-1"],
                          "checkpoint_every=-1 must be an integer >= 0"),
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


# What every flag and flag file parsed to before the flags were generated
# from the config dataclasses: tests/data/configs_before.json was written by
# running the old scripts/train.py (hand-written flags and mapping) on each
# case below; the generated flags must parse each one to the same config.
with open(os.path.join(ROOT, "tests", "data", "configs_before.json")) as f:
  BEFORE = json.load(f)
_ABSENT = "<absent>"
# Settings added after the fixture was written, at their defaults.
NEW_DEFAULTS = {"loop.stop_when": None, "all_reduce.overlap": False,
                "model_options.num_layers": 2, "model_options.num_heads": 4,
                "model_options.model_width": 128,
                "model_options.vocab_size": 0,
                "model_options.tie_embeddings": True,
                # The best checkpoint, early stopping, eval sets.
                "loop.best_metric": None, "loop.best_mode": "auto",
                "loop.best_min_delta": 0.0,
                "loop.early_stopping_patience": None,
                "loop.early_stopping_start_step": 0,
                "loop.restore_best_on_stop": False, "loop.eval_steps": None,
                "eval_sets": {"tuple": []},
                # Warm start, XLA, optimizer-state sharding.
                "init_checkpoint": None, "init_exclude": None,
                "init_skip_mismatch": False, "jit_compile": False,
                "shard_optimizer_state": False,
                "model_parallel.mesh": "", "model_parallel.data_axis": 1,
                "model_parallel.tensor_stages": 1,
                # Preprocessing layers adapted on the training data.
                "adapt_examples": 10000,
                # Slow workers named.
                "loop.straggler_factor": 1.5,
                # Loss spikes, background saves, warmup-stable-decay and
                # weight-decay groups.
                "spike_policy": "none", "spike_factor": 4.0,
                "spike_window": 50, "loop.async_checkpoint": False,
                "optimizer.decay_fraction": 0.2,
                "optimizer.decay_shape": "linear",
                "weight_decay_exclude": None,
                "loop.checkpoint_sharding": "gathered",
                "log_layer_norms": False, "shard_gradients": False,
                "shard_parameters": False}


def _flat(value, prefix=""):
  """{dotted field: value} of a config (dicts and nested configs opened,
  tuples tagged as the fixture writes them); hparams left out."""
  if dataclasses.is_dataclass(value):
    value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)
             if f.name != "hparams"}
  out = {}
  for key, item in value.items():
    if isinstance(item, dict) or dataclasses.is_dataclass(item):
      out.update(_flat(item, f"{prefix}{key}."))
    else:
      out[prefix + key] = _tagged(item)
  return out


def _tagged(value):
  if isinstance(value, tuple):
    return {"tuple": [_tagged(v) for v in value]}
  return value


def _args(args):
  return [a.replace("--flagfile=scripts/", f"--flagfile={ROOT}/scripts/")
          for a in args]


def test_every_old_flag_is_still_defined_with_its_type_and_default():
  assert len(BEFORE["flags"]) == 76
  for name, old in BEFORE["flags"].items():
    assert name in flags.FLAGS, f"--{name} is gone"
    flag = flags.FLAGS[name]
    assert (flag.flag_type(), flag.default, flag.boolean) == (
        old["type"], old["default"], old["boolean"]), name


def test_defaults_parse_to_the_same_config():
  assert _flat(_config("--train_steps=1")) == dict(BEFORE["defaults"],
                                                   **NEW_DEFAULTS)


@pytest.mark.parametrize("case", sorted(BEFORE["configs"]))
def test_each_old_command_line_parses_to_the_same_config(case):
  expected = dict(BEFORE["configs"][case]["differs"])
  # Since then the config resolves its folders (made absolute, once).
  for key in ("model_dir", "data_dir"):
    if isinstance(expected.get(key), str):
      expected[key] = app_config.absolute_path(expected[key])
  if any("unet_shapes.cfg" in a for a in BEFORE["configs"][case]["args"]):
    # The flag file has synchronised its BatchNorms since (it trains on 2
    # replicas as on one).
    expected["model_options.sync_batch_norm"] = True
  got = _flat(_config(*_args(BEFORE["configs"][case]["args"])))
  defaults = dict(BEFORE["defaults"], **NEW_DEFAULTS)
  if ":" in expected.get("model", ""):
    # Since then a model of one's own keeps its own defaults: the built-in
    # model flags left at theirs no longer fill its options.
    expected.update({k: _ABSENT for k in defaults
                     if k.startswith("model_options.")})
  differs = {k: got.get(k, _ABSENT)
             for k in sorted(set(got) | set(defaults))
             if got.get(k, _ABSENT) != defaults.get(k, _ABSENT)}
  assert differs == expected


@pytest.mark.parametrize("case", sorted(BEFORE["errors"]))
def test_each_old_bad_command_line_still_fails_naming_the_flag(case):
  expected = BEFORE["errors"][case]
  with pytest.raises((ConfigError, flags.Error)) as error:
    _config(*expected["args"])
  assert expected["names"] in str(error.value)


def _config_classes(cls=ExperimentConfig):
  """The config dataclasses reachable from `cls` (fields and options)."""
  found = [cls]
  hints = typing.get_type_hints(cls)
  for field in dataclasses.fields(cls):
    meta = settings.info(field) or {}
    for nested in (config_flags._nested(hints[field.name]),  # pylint: disable=protected-access
                   meta.get("options")):
      if nested is not None and nested not in found:
        found += _config_classes(nested)
  return found


def _hand_written_flags():
  """Names of the flags scripts/train.py defines itself."""
  tree = ast.parse(open(os.path.join(ROOT, "scripts", "train.py")).read())
  return {node.args[0].value for node in ast.walk(tree)
          if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
          and node.func.attr.startswith("DEFINE")
          and isinstance(node.args[0], ast.Constant)}


def test_train_py_defines_no_flag_that_a_config_field_holds():
  held = set()
  for cls in _config_classes():
    for field in dataclasses.fields(cls):
      held |= {field.name, settings.flag_name(field) or field.name}
  hand = _hand_written_flags()
  assert hand, "the AST walk found no DEFINE_* call"
  assert not hand & held, (
      f"declare these as config fields (framework.settings.setting), not as "
      f"flags in scripts/train.py: {sorted(hand & held)}")
  # Every setting is a flag of train.py, and --helpshort lists it.
  generated = {f.name for f in config_flags.walk()}
  assert generated <= set(train.TRAIN_FLAGS)
  assert generated <= {f.name for f in
                       flags.FLAGS.get_key_flags_for_module(train)}
  assert len(generated) == len(list(config_flags.walk())), "a name twice"


def test_every_config_field_is_a_setting_or_a_nested_config():
  # A plain field would be a setting without a flag, help or checks.
  for cls in _config_classes():
    hints = typing.get_type_hints(cls)
    plain = [f.name for f in dataclasses.fields(cls)
             if settings.info(f) is None
             and not config_flags._nested(hints[f.name])  # pylint: disable=protected-access
             and (cls, f.name) != (ExperimentConfig, "hparams")]
    assert not plain, f"{cls.__name__}: declare {plain} with setting(...)"


def test_hparams_are_the_key_settings_and_those_not_at_their_default():
  config = _config("--model=mlp", "--train_steps=5", "--keep_checkpoints=5",
                   "--hidden_units=8", "--seed=0", "--cpu_devices=2")
  key = {"model", "dataset", "strategy", "global_batch_size", "train_steps",
         "epochs", "optimizer", "learning_rate", "lr_schedule",
         "mixed_precision"}
  assert set(config_flags.key_flags()) == key
  # --seed=0 is the default: not shown.
  assert set(config.hparams) == key | {"keep_checkpoints", "hidden_units",
                                       "cpu_devices"}
  assert config.hparams["hidden_units"] == (8,)
  assert config.hparams["epochs"] is None
  assert config.hparams["cpu_devices"] == 2


def test_hparams_of_a_config_built_in_python():
  # What experiment.run shows for a config without hparams (no flags).
  config = ExperimentConfig(
      model="mlp", train_steps=3, model_options={"hidden_units": (8,),
                                                 "dropout": True, "blocks": 2},
      optimizer=OptimizerConfig(learning_rate=0.1, name="sgd"),
      loop=LoopConfig(train_steps=3, eval_every=2))
  assert settings.hparams(config) == {
      "model": "mlp", "dataset": "cifar10", "strategy": "default",
      "global_batch_size": 128, "train_steps": 3, "epochs": None,
      "optimizer": "sgd", "learning_rate": 0.1, "lr_schedule": "constant",
      "mixed_precision": "float32", "hidden_units": (8,), "eval_every": 2,
      "model_options.blocks": 2}


USER_MODEL = '''
RECEIVED = []


def build(input_shape, num_classes, *, blocks: int = 2, act="relu",
          scale=1.0, sizes=(8,), tag: str = None, residual=False):
  import keras
  RECEIVED.append(dict(blocks=blocks, act=act, scale=scale, sizes=sizes,
                       tag=tag, residual=residual))
  return keras.Sequential([keras.Input(input_shape), keras.layers.Flatten(),
                           keras.layers.Dense(num_classes)])
'''


@pytest.fixture
def user_model(tmp_path, monkeypatch):
  (tmp_path / "user_nets.py").write_text(USER_MODEL)
  monkeypatch.syspath_prepend(str(tmp_path))
  yield "user_nets:build"
  sys.modules.pop("user_nets", None)


def test_model_options_are_typed_from_the_builder_and_reach_it(user_model):
  config = _config(f"--model={user_model}", "--train_steps=1",
                   "--model_options=blocks=3,act=gelu,scale=2,sizes=4,2,"
                   "tag=a,residual=true")
  options = {k: v for k, v in config.model_options.items()
             if k in ("blocks", "act", "scale", "sizes", "tag", "residual")}
  assert options == dict(blocks=3, act="gelu", scale=2.0, sizes=(4, 2),
                         tag="a", residual=True)
  assert [type(options[k]) for k in ("blocks", "scale", "sizes")] == [
      int, float, tuple]
  # The built-in options left at their defaults do not reach a model of
  # one's own (it keeps its own defaults); one given does.
  assert "hidden_units" not in config.model_options
  given = _config(f"--model={user_model}", "--train_steps=1",
                  "--hidden_units=8")
  assert given.model_options == {"hidden_units": (8,)}
  _optimizer_and_loop(config)
  import user_nets  # pylint: disable=g-import-not-at-top
  assert user_nets.RECEIVED[-1] == options


def test_model_options_override_the_built_in_flags():
  config = _config("--model=unet", "--train_steps=1", "--unet_depth=2",
                   "--model_options=depth=3")
  assert (config.model_options["depth"], config.model_options["width"]) == (
      3, 32)


@pytest.mark.parametrize("value,fragments", [
    ("blocks=3,colour=red", ["'colour' is not an option of "
                             "model='user_nets:build'",
                             "valid keys: blocks, act, scale, sizes, tag, "
                             "residual"]),
    ("blocks=three", ["blocks='three' is not a valid int",
                      "valid keys for model='user_nets:build': blocks"]),
    ("residual=maybe", ["residual='maybe' is not a valid bool"]),
    ("sizes=4,x", ["sizes='4,x' is not a valid list of int"]),
    ("blocks", ["'blocks' is not key=value"]),
])
def test_a_bad_model_option_is_one_line_naming_it_and_the_valid_keys(
    user_model, value, fragments, capsys):
  with pytest.raises(SystemExit) as exit_:
    with cli.one_line_errors():
      _config(f"--model={user_model}", "--train_steps=1",
              f"--model_options={value}")
  assert exit_.value.code == 1
  [line] = capsys.readouterr().err.splitlines()
  assert ": error: model_options" in line
  for fragment in fragments:
    assert fragment in line
