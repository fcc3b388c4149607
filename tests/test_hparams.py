"""Each run is one session of TensorBoard's HParams dashboard."""

import os

import pytest
from tensorboard import context
from tensorboard.backend.event_processing import data_provider
from tensorboard.backend.event_processing import plugin_event_multiplexer
from tensorboard.plugins import base_plugin
from tensorboard.plugins.hparams import api_pb2
from tensorboard.plugins.hparams import backend_context
from tensorboard.plugins.hparams import metadata

from framework.core.summaries import SummaryWriter, hparam_value
from helpers import run_script

FLAGS = ["--model=mlp", "--dataset=synthetic", "--hidden_units=16,8",
         "--global_batch_size=32", "--optimizer=momentum", "--train_steps=4",
         "--summary_every=2", "--export_saved_model=false"]
LEARNING_RATES = {"lr_a": 0.05, "lr_b": 0.01}
# Shown for every run, even at their defaults (framework.settings, key=True).
KEY_SETTINGS = {"model", "dataset", "strategy", "global_batch_size",
                "train_steps", "epochs", "optimizer", "learning_rate",
                "lr_schedule", "mixed_precision"}


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
  """Two runs of a sweep under one TensorBoard logdir."""
  logdir = tmp_path_factory.mktemp("sweep")
  for name, lr in LEARNING_RATES.items():
    run_script("train.py", *FLAGS, f"--learning_rate={lr}",
               f"--model_dir={logdir / name}")
  return str(logdir)


def multiplexer(logdir):
  mux = plugin_event_multiplexer.EventMultiplexer()
  mux.AddRunsFromDirectory(logdir)
  mux.Reload()
  return mux


def session_hparams(mux, run):
  content = mux.PluginRunToTagToContent(metadata.PLUGIN_NAME)[run][
      metadata.SESSION_START_INFO_TAG]
  info = metadata.parse_session_start_info_plugin_data(content)
  return {k: v.WhichOneof("kind") and getattr(v, v.WhichOneof("kind"))
          for k, v in info.hparams.items()}


def test_each_run_records_its_flags(sweep):
  mux = multiplexer(sweep)
  # The session is the run's model_dir; train/ and eval/ are below it.
  assert set(mux.PluginRunToTagToContent(metadata.PLUGIN_NAME)) == set(
      LEARNING_RATES)
  for name, lr in LEARNING_RATES.items():
    values = session_hparams(mux, name)
    assert values["learning_rate"] == pytest.approx(lr)
    assert values["strategy"] == "default"
    assert values["train_steps"] == 4
    assert values["hidden_units"] == "16,8"
    # The key settings, and the others only where they differ from their
    # defaults (--dropout, --clip_norm, ... are not columns).
    assert set(values) == KEY_SETTINGS | {
        "hidden_units", "summary_every", "export_saved_model", "model_dir"}


def test_dashboard_compares_runs_on_final_metrics(sweep):
  # What the dashboard computes: hyperparameter columns over the sessions,
  # and metrics from the scalar tags in and below each session's directory.
  mux = multiplexer(sweep)
  provider = data_provider.MultiplexerDataProvider(mux, sweep)
  hp_context = backend_context.Context(base_plugin.TBContext(
      logdir=sweep, multiplexer=mux, data_provider=provider))
  ctx = context.RequestContext()
  experiment = hp_context.experiment_from_metadata(
      ctx, "", include_metrics=True,
      hparams_run_to_tag_to_content=hp_context.hparams_metadata(ctx, ""),
      data_provider_hparams=None)
  infos = {i.name: i for i in experiment.hparam_infos}
  assert infos["learning_rate"].type == api_pb2.DATA_TYPE_FLOAT64
  assert infos["learning_rate"].differs
  assert not infos["model"].differs
  metrics = {(m.name.group, m.name.tag) for m in experiment.metric_infos}
  assert {("eval", "accuracy"), ("eval", "loss"),
          ("train", "loss")} <= metrics
  # The value the table shows is the last one: the final evaluation's.
  last = hp_context.read_last_scalars(ctx, "", None)
  for name in LEARNING_RATES:
    assert os.path.join(name, "eval") in last
    [final] = [v for k, v in last[os.path.join(name, "eval")].items()
               if k == "accuracy"]
    assert final.step == 4 and 0 <= final.value <= 1


def test_values_become_scalars(tmp_path):
  assert hparam_value([64, 32]) == "64,32"
  assert hparam_value(()) == ""
  assert hparam_value(None) == "None"
  assert hparam_value(True) is True
  assert hparam_value(3) == 3 and hparam_value(0.5) == 0.5
  import numpy as np  # pylint: disable=g-import-not-at-top
  assert type(hparam_value(np.float32(0.5))) is float
  assert type(hparam_value(np.int64(7))) is int
  writer = SummaryWriter(str(tmp_path), "")
  writer.hparams({"units": [4, 2], "decay": None, "name": "x"})
  writer.close()
  values = session_hparams(multiplexer(str(tmp_path)), ".")
  assert values == {"units": "4,2", "decay": "None", "name": "x"}
