"""A run resolves its config once into a `RunPlan` that the layers below
read: the precision and the dataset's task are decided once per run (the
self-check included), and model_info.json records the plan."""

import dataclasses
import json
import os

import pytest

from framework import LoopConfig
from framework.app import experiment, run_plan
from framework.core import precision
from framework.core.config import PRECISIONS
from framework.errors import ConfigError
from framework.tasks import language_model, segmentation
import shared_strategy
from tests.helpers import tiny_mlp_config


_config = tiny_mlp_config


def _count(monkeypatch, module, name):
  calls = []
  original = getattr(module, name)

  def counted(*args, **kwargs):
    calls.append(args)
    return original(*args, **kwargs)

  monkeypatch.setattr(module, name, counted)
  return calls


@pytest.mark.slow
def test_a_run_decides_precision_and_task_once_and_records_its_plan(
    tmp_path, monkeypatch):
  resolved = _count(monkeypatch, precision, "resolve_precision")
  per_pixel = _count(monkeypatch, segmentation, "is_segmentation")
  tasks = _count(monkeypatch, language_model, "task_name")
  # The self-check builds two more trainers from the same plan.
  experiment.run(_config(tmp_path / "run", mixed_precision="auto",
                         check_distribution=True),
                 strategy=shared_strategy.mirrored())
  assert [args[0] for args in resolved] == ["auto"]
  assert len(per_pixel) == 1
  assert len(tasks) == 1
  with open(os.path.join(tmp_path, "run", "model_info.json")) as f:
    info = json.load(f)
  plan = info["run_plan"]
  assert plan["task"] == "classification"
  assert plan["precision"] == info["mixed_precision"]
  assert plan["precision"] in PRECISIONS
  assert plan["replicas"] == 2 and len(plan["devices"]) == 2
  assert plan["chief"] and not plan["parameter_server"]
  assert plan["model_parallel"]["mode"] == "none"
  assert plan["eval"] == {"splits": ["eval"], "best_metric": None,
                          "best_mode": "auto", "stop_when": None}


def test_resolve_reads_the_task_and_touches_no_file(tmp_path):
  config = _config(tmp_path / "run", model="unet", dataset="shapes",
                   model_options={}, dataset_options={"image_size": 32},
                   loop=LoopConfig(train_steps=1, best_metric="eval/mean_iou"))
  plan = run_plan.resolve(config)
  assert plan.task == "segmentation" and plan.is_segmentation
  assert not plan.is_language_model
  assert plan.precision == "float32" and plan.replicas == 1
  assert plan.eval.best_metric == "eval/mean_iou"
  assert plan.record()["eval"]["splits"] == ["eval"]
  assert plan.dataset.name == "shapes"
  assert not os.path.exists(tmp_path / "run")
  with pytest.raises(dataclasses.FrozenInstanceError):
    plan.task = "classification"


def test_a_batch_the_replicas_cannot_share_fails_before_the_model_dir(
    tmp_path):
  # Checked once, by the Trainer the run builds, before any file.
  with pytest.raises(ConfigError, match="global_batch_size=33 is not "
                     "divisible by the 2 replicas of MirroredStrategy; use a "
                     "multiple of 2"):
    experiment.run(_config(tmp_path / "run", global_batch_size=33),
                   strategy=shared_strategy.mirrored())
  assert not os.path.exists(tmp_path / "run")

