"""Several named eval sets and partial evaluation: `eval/` and
`eval_<name>/` each exact on 2 replicas, `stop_when` / `best_metric` on a
second set, `--eval_sets` and `--eval_steps` from flags."""

import dataclasses
import json
import logging

import numpy as np
import pytest
import tensorflow as tf

import framework
from framework import ExperimentConfig, LoopConfig
from framework.app import experiment
from framework.app import config as app_config
from framework.core import evaluation
from helpers import assert_one_line_error, run_script, snapshot
from shared_strategy import mirrored
from framework.core.controller import Controller
from test_controller import (_data, eval_input, make_controller, scalars,
                             train_input)


def _rows(n, seed):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, 3)).astype(np.float32)
  return x, (x @ np.array([1.0, -2.0, 0.5], np.float32)).astype(np.float32)


def _mae(model, x, y):
  return float(np.mean(np.abs(model(x, training=False).numpy()[:, 0] - y)))


@pytest.mark.slow
def test_two_eval_sets_are_each_exact_on_two_replicas(tmp_path):
  x, y = _rows(13, 1)  # batches of 8: the last one holds 5 rows
  test = tf.data.Dataset.from_tensor_slices((x, y))
  controller = make_controller(
      tmp_path, 8, eval_input=lambda: _data().batch(8),
      eval_inputs={"test": lambda: test.batch(8)})
  assert controller.trainer.strategy.num_replicas_in_sync == 2
  controller.config = dataclasses.replace(controller.config, eval_every=4)
  results = controller.run()
  found = controller.eval_results
  assert list(found) == ["eval", "eval_test"]
  assert results is found["eval"]
  assert found["eval"]["examples"] == 40 and found["eval_test"]["examples"] == 13
  model = controller.trainer.model
  ex, ey = (np.stack([np.asarray(t) for t in c]) for c in zip(*list(
      _data().as_numpy_iterator())))
  assert found["eval"]["mae"] == pytest.approx(_mae(model, ex, ey), rel=1e-5)
  assert found["eval_test"]["mae"] == pytest.approx(_mae(model, x, y),
                                                    rel=1e-5)
  for split in ("eval", "eval_test"):
    assert sorted(scalars(str(tmp_path / split), "mae")) == [4, 8], split
  assert scalars(str(tmp_path / "eval_test"), "mae")[8] == pytest.approx(
      found["eval_test"]["mae"])


@pytest.mark.slow
def test_stop_when_on_the_second_set_stops_the_run(tmp_path):
  x, y = _rows(13, 1)
  made = make_controller(tmp_path / "unused", 40)
  controller = Controller(
      made.trainer, dataclasses.replace(made.config, eval_every=4,
                                        stop_when="eval_test/mae<1e9"),
      str(tmp_path), train_input=train_input, eval_input=eval_input,
      eval_inputs={"test": lambda: tf.data.Dataset.from_tensor_slices(
          (x, y)).batch(8)})
  controller.run()
  assert controller.step == 4
  assert list(scalars(str(tmp_path / "eval_test"),
                      "time_to_target_seconds")) == [4]
  # A split the run does not have is one ConfigError.
  with pytest.raises(framework.ConfigError, match="no eval set named"):
    evaluation.results_of(controller, "eval_val", {})
  with pytest.raises(framework.ConfigError, match="given twice"):
    make_controller(tmp_path / "b", 4, eval_inputs={"eval": _data})
  with pytest.raises(framework.ConfigError, match="eval set name"):
    make_controller(tmp_path / "c", 4, eval_inputs={"a b": _data})


@pytest.mark.slow
def test_eval_steps_evaluates_the_first_batches_and_says_so(tmp_path, caplog):
  controller = make_controller(tmp_path, 4)
  controller.config = dataclasses.replace(controller.config, eval_steps=2)
  caplog.set_level(logging.INFO)
  results = controller.run()
  assert results["examples"] == 16  # 2 global batches of 8 (of 40)
  assert "eval_steps=2: the first 2 global batches only" in caplog.text
  assert scalars(str(tmp_path / "eval"), "eval_steps") == {4: 2.0}
  # An already distributed input cannot be cut: one ConfigError.
  strategy = controller.trainer.strategy
  other = make_controller(
      tmp_path / "d", 4, eval_input=lambda: strategy.
      experimental_distribute_dataset(_data().batch(8)))
  other.config = controller.config
  with pytest.raises(framework.ConfigError, match="cannot be cut"):
    other.evaluate()


def _config(model_dir, **loop):
  return ExperimentConfig(
      model="mlp", dataset="synthetic", model_dir=str(model_dir),
      global_batch_size=48, train_steps=10, export_saved_model=False,
      strategy="mirrored", model_options=dict(hidden_units=(8,)),
      eval_sets=("test:synthetic::train",),
      loop=LoopConfig(train_steps=1, steps_per_loop=5, eval_every=5,
                      summary_every=0, log_every=0, **loop))


@pytest.mark.slow
def test_eval_sets_from_the_config_with_best_metric_and_stop_when(tmp_path):
  # 2048 training examples in batches of 48 on 2 replicas: padded.
  results = experiment.run(_config(
      tmp_path, best_metric="eval_test/loss",
      stop_when="eval_test/accuracy>=0.0"), strategy=mirrored())
  assert results["examples"] == 512
  with open(tmp_path / "best" / "best.json") as f:
    best = json.load(f)
  assert best["split"] == "eval_test" and best["mode"] == "min"
  assert best["step"] == 5 and best["metrics"]["examples"] == 2048
  assert best["value"] == pytest.approx(
      scalars(str(tmp_path / "eval_test"), "loss")[5])
  assert list(scalars(str(tmp_path / "eval_test"),
                      "time_to_target_seconds")) == [5]
  assert sorted(scalars(str(tmp_path / "eval"), "loss")) == [5]


def test_eval_set_specs_parse():
  parse = app_config.parse
  assert parse("test:cifar10") == app_config.EvalSetSpec(
      "test", "cifar10")
  spec = parse("v:tfds:mnist:3.0.1:/data/tfds:train")
  assert (spec.dataset, spec.data_dir, spec.split) == (
      "tfds:mnist:3.0.1", "/data/tfds", "train")
  assert parse("v:tfds:mnist:/data").dataset == "tfds:mnist"
  assert parse("h:synthetic::train").data_dir is None


@pytest.mark.slow
@pytest.mark.parametrize("flag,fragment", [
    ("--eval_sets=test", "NAME:DATASET[:DATA_DIR[:SPLIT]]"),
    ("--eval_sets=eval:synthetic", "not eval or standalone"),
    ("--eval_sets=a:synthetic::valid", "split 'valid'"),
    ("--eval_sets=a:synthetic,a:synthetic", "names 'a' twice"),
    ("--eval_sets=a:cifar10:/nonexistent", "data_dir='/nonexistent'"),
    ("--eval_steps=-1", "eval_steps=-1"),
    ("--stop_when=eval_a/accuracy>0.5", "eval set 'a'"),
])
def test_a_bad_eval_set_flag_is_one_line(tmp_path, flag, fragment):
  before = snapshot(tmp_path)
  proc = run_script("train.py", "--model=mlp", "--dataset=synthetic",
                    "--train_steps=2", f"--model_dir={tmp_path / 'run'}",
                    flag, check=False)
  assert_one_line_error(proc, "train.py", fragment, unchanged=before)
