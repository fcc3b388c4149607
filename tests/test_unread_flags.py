"""A flag the run does not read is one warning line, from a table.

Settings declare the choices that read them (`setting(read_by=...)`),
train.py its own flags (`train.READ_BY`); `config_flags.unread_flags`
compares what the command line and its flag files set with the final
--model, --dataset, --strategy, ... .
"""

import inspect

from absl import flags
import pytest

from helpers import run_script
from scripts import config_flags
from scripts import train

# Every train.py flag that every choice reads. A new flag goes here or
# declares `read_by` (so none skips the warning's table by accident).
READ_BY_EVERY_CHOICE = {
    "adapt_examples", "all_reduce_bytes_per_pack", "all_reduce_dtype",
    "async_checkpoint",
    "all_reduce_implementation", "all_reduce_overlap", "allow_config_change",
    "augment", "check_distribution", "checkpoint_every",
    "checkpoint_sharding", "clip_norm",
    "cpu_devices", "dataset", "deterministic", "ema_decay", "ema_warmup",
    "epochs", "eval_every", "eval_start_step", "eval_tta",
    "export_saved_model", "global_batch_size", "grad_accum_steps",
    "input_mode", "keep_checkpoints", "label_smoothing", "learning_rate",
    "log_every", "lr_scaling", "lr_schedule", "malloc", "mixed_precision",
    "model", "model_dir", "model_options", "model_parallel", "nan_policy",
    "nesterov", "onednn", "optimizer", "profile_steps", "restore", "seed",
    "recompute", "serial_stages", "spike_policy", "steps_per_loop", "stop_at_accuracy", "stop_when",
    "strategy", "summary_every", "train_steps", "warmup_steps",
    # Read by every choice (a strategy that cannot shard is a config error;
    # parameter_server warns that it compiles no XLA).
    "best_metric", "best_min_delta", "best_mode", "early_stopping_patience",
    "early_stopping_start_step", "eval_sets", "eval_steps",
    "init_checkpoint", "init_exclude", "init_skip_mismatch", "jit_compile",
    "restore_best_on_stop", "shard_optimizer_state", "mesh",
    "shard_gradients", "shard_parameters"}


def _unread(*args):
  values = flags.FlagValues()
  config_flags.define_flags(values)
  argv = ["train.py", *args]
  values(argv)
  return [name for name, _ in config_flags.unread_flags(argv, values)]


@pytest.mark.parametrize("args, unread", [
    (["--dataset=synthetic", "--data_dir=afile"], ["data_dir"]),
    (["--dataset=cifar10", "--data_dir=afile"], []),
    (["--dataset=shapes", "--data_dir", "afile"], ["data_dir"]),
    (["--tpu=grpc://x:1"], ["tpu"]),
    (["--strategy=tpu", "--tpu=grpc://x:1"], []),
    (["--model=cifar_cnn", "--hidden_units=8"], ["hidden_units"]),
    (["--model=mlp", "--num_heads=2", "--nodropout"], ["dropout",
                                                       "num_heads"]),
    (["--model=unet", "--sync_batch_norm", "--unet_depth=2"], []),
    (["--model=my.module:build", "--hidden_units=8", "--num_heads=2"], []),
    (["--dataset=my_own", "--image_size=8"], []),
    (["--dataset=tfds:mnist", "--image_key=img", "--image_size=8"], []),
    (["--dataset=synthetic", "--sequence_length=8", "--image_key=img"],
     ["image_key", "sequence_length"]),
    (["--optimizer=adam", "--momentum=0.5", "--lr_step_decay=0.5"],
     ["momentum", "lr_step_decay"]),
    (["--optimizer=momentum", "--momentum=0.5", "--lr_schedule=step",
      "--lr_step_decay=0.5", "--lr_min_ratio=0.1"], ["lr_min_ratio"]),
    (["--num_stages=4", "--num_shards=2"], ["num_stages", "num_shards"]),
    (["--model_parallel=pipeline", "--num_stages=4", "--num_shards=2"],
     ["num_shards"]),
    (["--mesh=data:2,model:2", "--model_parallel_devices=cluster",
      "--num_stages=4"], ["num_stages"]),
    (["--mesh=data:2,pipeline:2", "--num_microbatches=2", "--num_shards=2"],
     ["num_shards"]),
    (["--max_skipped_steps=3"], ["max_skipped_steps"]),
    (["--nan_policy=skip", "--max_skipped_steps=3"], []),
    (["--", "--data_dir=afile"], []),
])
def test_each_unread_flag_is_named(args, unread):
  assert sorted(_unread(*args)) == sorted(unread)


def test_flag_files_count_with_their_own_choices(tmp_path):
  recipe = tmp_path / "mlp.cfg"
  recipe.write_text("--model=mlp\n--hidden_units=32\n--dataset=synthetic\n")
  # The recipe's --hidden_units is for the recipe's model: fine.
  assert _unread(f"--flagfile={recipe}", "--model=cifar_cnn") == []
  # Set on the command line, it is held against the final model.
  assert _unread(f"--flagfile={recipe}", "--model=cifar_cnn",
                 "--hidden_units=8") == ["hidden_units"]
  # A flag file's flag its own choices do not read either.
  stray = tmp_path / "stray.cfg"
  stray.write_text("--dataset=synthetic\n--data_dir=/data/cifar\n")
  assert _unread("--flagfile", str(stray)) == ["data_dir"]
  assert _unread(f"--flagfile={stray}", "--dataset=cifar10") == []


def test_every_train_flag_is_read_by_every_choice_or_in_the_table():
  names, own = train.TRAIN_FLAGS, train.READ_BY
  table = set(config_flags.read_by_table()) | set(own)
  assert not table & READ_BY_EVERY_CHOICE, table & READ_BY_EVERY_CHOICE
  assert set(names) - table == READ_BY_EVERY_CHOICE, (
      "declare read_by for the new flag, or add it to READ_BY_EVERY_CHOICE: "
      f"{sorted(set(names) - table ^ READ_BY_EVERY_CHOICE)}")
  for name, read_by in config_flags.read_by_table(
      {n: None for n in own}).items():
    for choice in read_by or {}:
      assert choice in names, (name, choice)


def test_the_model_options_table_matches_the_builders():
  import models  # pylint: disable=g-import-not-at-top
  from framework.app.config import BUILTIN_MODELS  # pylint: disable=g-import-not-at-top
  from framework import settings  # pylint: disable=g-import-not-at-top
  assert sorted(models.registry.model_names()) == sorted(BUILTIN_MODELS)
  for model in BUILTIN_MODELS:
    takes = set(inspect.signature(models.registry.get_builder(model))
                .parameters)
    for flag in config_flags.walk():
      if flag.path[0] == "model_options" and flag.kind is not dict:
        assert settings.is_read(flag.meta["read_by"], {"model": model}) == (
            flag.path[1] in takes), (model, flag.name)


def test_the_dataset_names_are_the_registered_ones():
  from framework.data import datasets  # pylint: disable=g-import-not-at-top
  from framework.data.config import DATASET_NAMES  # pylint: disable=g-import-not-at-top
  for module in datasets._REGISTERING_MODULES:  # pylint: disable=protected-access
    __import__(module)
  assert sorted(datasets.DATASETS) == sorted(
      n.replace(":*", "") for n in DATASET_NAMES)


@pytest.mark.slow
def test_train_py_warns_in_one_line_and_trains(tmp_path):
  (tmp_path / "afile").write_text("not data")
  proc = run_script("train.py", "--model=mlp", "--hidden_units=16",
                    "--dataset=synthetic", "--global_batch_size=32",
                    "--train_steps=2", "--data_dir=afile",
                    "--startup_timeout=30", "--model_dir=runs/w",
                    "--export_saved_model=false", cwd=tmp_path)
  lines = [l for l in proc.stderr.splitlines() if "warning: " in l
           and l.startswith("train.py")]
  assert lines == [
      "train.py: warning: --data_dir is not read by --dataset=synthetic; "
      "--startup_timeout is not read by --strategy=default, "
      "--model_parallel_devices=local; they have no effect in this run"], (
          proc.stderr[-3000:])
  assert (tmp_path / "runs" / "w" / "ckpt-2.index").exists()
  quiet = run_script("train.py", "--model=mlp", "--hidden_units=16",
                     "--dataset=synthetic", "--global_batch_size=32",
                     "--train_steps=4", "--model_dir=runs/w",
                     "--export_saved_model=false", cwd=tmp_path)
  assert "warning: --" not in quiet.stderr


@pytest.mark.parametrize("args, unread", [
    (["--poll_seconds=1"], ["poll_seconds"]),
    (["--watch", "--poll_seconds=1"], []),
    (["--watch=True", "--poll_seconds", "1"], []),
    (["--nowatch", "--poll_seconds=1"], ["poll_seconds"]),
])
def test_an_apps_own_table_and_boolean_choices(args, unread):
  values = flags.FlagValues()
  flags.DEFINE_bool("watch", False, "", flag_values=values)
  flags.DEFINE_float("poll_seconds", 5.0, "", flag_values=values)
  argv = ["evaluate.py", *args]
  values(argv)
  table = {"poll_seconds": {"watch": ("true",)}}
  assert [n for n, _ in config_flags.unread_flags(
      argv, values, table=table)] == unread


@pytest.mark.slow
def test_evaluate_py_warns_about_its_own_flags(tmp_path):
  proc = run_script("evaluate.py", "--model_dir=runs/none",
                    "--timeout_seconds=3", "--tpu=grpc://x:1", check=False,
                    cwd=tmp_path)
  assert proc.returncode == 1  # no such run: the warning comes first
  assert ("evaluate.py: warning: --timeout_seconds is not read by "
          "--watch=false; --tpu is not read by --strategy=default; they "
          "have no effect in this run") in proc.stderr.splitlines(), (
              proc.stderr[-3000:])
