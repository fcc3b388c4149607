"""The best checkpoint and early stopping: a run whose accuracy peaks and
then falls (gradient ascent after step 30) keeps the peak in best/, stops
after `early_stopping_patience` evaluations without improvement, stays
finished when relaunched, and survives a kill -9 in the middle of a best
export."""

import dataclasses
import json
import logging
import os

import numpy as np
import pytest
import tensorflow as tf
from tensorboard.backend.event_processing import event_accumulator

from framework import ExperimentConfig, LoopConfig
from framework.app import evaluation, experiment
from framework.core.checkpoints import best as best_lib
from framework.core.checkpoints import manager
from framework.core.config import OptimizerConfig
from helpers import assert_one_line_error, run_code, run_script, snapshot
from shared_strategy import mirrored


def _config(model_dir, strategy="default", **loop):
  loop = dict(dict(steps_per_loop=5, eval_every=5, checkpoint_every=10,
                   summary_every=0, log_every=0, best_metric="eval/accuracy",
                   early_stopping_patience=2), **loop)
  return ExperimentConfig(
      model="mlp", dataset="synthetic", model_dir=str(model_dir),
      global_batch_size=64, train_steps=80, export_saved_model=False,
      strategy=strategy, model_options=dict(hidden_units=(32,)),
      # Descends until step 30, then climbs (a negative rate): accuracy
      # peaks, then falls, with a finite loss.
      optimizer=OptimizerConfig(name="sgd", learning_rate=0.05,
                                schedule="step", step_boundaries=(30,),
                                step_decay=-1.0),
      loop=LoopConfig(train_steps=1, **loop))


def _events(logdir):
  acc = event_accumulator.EventAccumulator(
      str(logdir), size_guidance={event_accumulator.TENSORS: 0})
  acc.Reload()
  return acc


def _scalars(logdir, tag):
  return {e.step: float(tf.make_ndarray(e.tensor_proto))
          for e in _events(logdir).Tensors(tag)}


def _best(model_dir):
  with open(os.path.join(model_dir, "best", "best.json")) as f:
    return json.load(f)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  model_dir = tmp_path_factory.mktemp("best") / "run"
  results = experiment.run(_config(model_dir))
  return model_dir, results


@pytest.mark.slow
def test_best_json_names_the_peak_and_the_run_stops_after_its_patience(run):
  model_dir, results = run
  accuracy = _scalars(model_dir / "eval", "accuracy")
  peak = max(accuracy, key=accuracy.get)
  last = max(accuracy)
  assert 10 <= peak < last < 80  # it peaked, fell and stopped early
  assert [s for s in sorted(accuracy) if s > peak] == [peak + 5, peak + 10]
  best = _best(model_dir)
  assert best["step"] == peak and best["metric"] == "eval/accuracy"
  assert best["value"] == pytest.approx(accuracy[peak], rel=1e-6)
  assert best["split"] == "eval" and best["mode"] == "max"
  assert best["epoch"] == pytest.approx(peak / (2048 // 64), abs=1e-3)
  assert best["metrics"]["examples"] == 512
  assert manager.damage(str(model_dir / "best" / "ckpt")) is None
  # The stop reason: the run's record, TensorBoard.
  with open(model_dir / "stopped_early.json") as f:
    record = json.load(f)
  assert record["step"] == last and "early stopping" in record["reason"]
  assert f"at step {peak}" in record["reason"]
  assert results["accuracy"] == pytest.approx(accuracy[last])
  texts = _events(model_dir / "eval").Tensors("stop_reason")
  assert [e.step for e in texts] == [last]
  assert b"did not improve" in tf.make_ndarray(texts[0].tensor_proto).item()
  # Rotation kept 3 checkpoints; best/ is not one of them.
  assert tf.train.latest_checkpoint(str(model_dir)).endswith(f"ckpt-{last}")


@pytest.mark.slow
def test_the_best_checkpoint_evaluates_to_the_peak(run):
  model_dir, _ = run
  best = _best(model_dir)
  result = evaluation.Evaluator(evaluation.EvalConfig(
      model_dir=str(model_dir),
      checkpoint=best_lib.resolve(str(model_dir)))).evaluate()
  assert result.step == best["step"]
  assert result.metrics["accuracy"] == pytest.approx(best["value"], rel=1e-6)
  assert result.metrics["loss"] == pytest.approx(best["metrics"]["loss"],
                                                 rel=1e-5)


@pytest.mark.slow
def test_the_relaunch_trains_nothing_and_says_why(run, caplog):
  model_dir, results = run
  before = sorted(os.listdir(model_dir))
  eval_events = sorted(os.listdir(model_dir / "eval"))
  best = snapshot(model_dir / "best")
  caplog.set_level(logging.INFO)
  again = experiment.run(_config(model_dir))
  assert again == pytest.approx(results)
  lines = [r.getMessage() for r in caplog.records
           if "Already finished" in r.getMessage()]
  assert len(lines) == 1 and "early stopping" in lines[0], caplog.text
  assert "Saved checkpoint" not in caplog.text
  assert "train step" not in caplog.text
  assert sorted(os.listdir(model_dir)) == before
  assert sorted(os.listdir(model_dir / "eval")) == eval_events
  assert snapshot(model_dir / "best") == best


@pytest.mark.slow
def test_evaluate_and_predict_take_weights_best_from_another_folder(
    run, tmp_path):
  model_dir, _ = run
  best = _best(model_dir)
  relative = os.path.relpath(model_dir, tmp_path)
  proc = run_script("evaluate.py", f"--model_dir={relative}",
                    "--weights=best", cwd=str(tmp_path))
  assert f"(step {best['step']}): 512 examples" in proc.stdout
  accuracy = float(proc.stdout.split("accuracy")[1].split()[0])
  assert accuracy == pytest.approx(best["value"], abs=1e-6)
  proc = run_script("predict.py", f"--model_dir={relative}",
                    "--weights=best", "--index=3", cwd=str(tmp_path))
  assert "predicted:" in proc.stdout
  # Not the final (diverged) weights: the best ones, as evaluation saw them.
  final = run_script("predict.py", f"--model_dir={relative}", "--index=3",
                     cwd=str(tmp_path))
  assert final.stdout != proc.stdout
  from framework.app import prediction  # pylint: disable=g-import-not-at-top
  info, weights = prediction.resolve_model(str(model_dir), "best")
  assert weights == str(model_dir / "best" / "model.weights.h5")
  # A run without best/: one line.
  empty = tmp_path / "plain"
  empty.mkdir()
  for script in ("evaluate.py", "predict.py"):
    proc = run_script(script, f"--model_dir={empty}", "--weights=best",
                      *(["--index=0"] if script == "predict.py" else []),
                      check=False)
    assert_one_line_error(proc, script, "no best checkpoint",
                          unchanged=snapshot(empty))


def _h5_weights(path):
  import h5py  # pylint: disable=g-import-not-at-top
  found = {}
  with h5py.File(path, "r") as f:
    f.visititems(lambda name, item: found.__setitem__(name, item[()])
                 if isinstance(item, h5py.Dataset) else None)
  return found


@pytest.mark.slow
def test_mirrored_with_an_ema_restores_the_averaged_best_on_stop(tmp_path):
  model_dir = tmp_path / "run"
  config = dataclasses.replace(
      _config(model_dir, restore_best_on_stop=True), strategy="mirrored",
      ema_decay=0.5)
  results = experiment.run(config, strategy=mirrored())
  best = _best(model_dir)
  accuracy = _scalars(model_dir / "eval", "accuracy")
  assert best["step"] == max(accuracy, key=accuracy.get) < max(accuracy)
  # The run ends with the best: its results and its weights file.
  assert results == pytest.approx(best["metrics"])
  final, kept = (_h5_weights(p) for p in (
      model_dir / "model.weights.h5", model_dir / "best" / "model.weights.h5"))
  assert final.keys() == kept.keys()
  for name in final:
    np.testing.assert_array_equal(final[name], kept[name], err_msg=name)
  # best/model.weights.h5 holds the averages evaluation used (2 replicas):
  # on one device they give the best value again.
  from framework.app import prediction  # pylint: disable=g-import-not-at-top
  from framework.data import datasets  # pylint: disable=g-import-not-at-top
  from framework.data.inputs import to_float  # pylint: disable=g-import-not-at-top
  info, weights = prediction.resolve_model(str(model_dir), "best")
  model = prediction.load_model(info, weights)
  data = datasets.synthetic()
  logits = model(to_float(tf.constant(data.test_x)), training=False)
  hits = float(np.mean(np.argmax(logits, -1) == data.test_y))
  assert hits == pytest.approx(best["value"], abs=1.5 / 512)
  # No worker folder is left behind; a relaunch keeps the best weights.
  assert not [n for n in os.listdir(model_dir) if n.startswith(".tmp")]
  assert experiment.run(config, strategy=mirrored()) == pytest.approx(
      best["metrics"])
  again = _h5_weights(model_dir / "model.weights.h5")
  for name in final:
    np.testing.assert_array_equal(again[name], kept[name], err_msg=name)


_KILL = """
import os, signal, sys
sys.path.insert(0, {tests!r})
from framework.app import experiment
from framework.core.checkpoints import best as best_lib
import test_best_checkpoint as t
exports = []
point = {point!r}
real_save, real_rename = best_lib._save_eval_weights, os.rename
def save(trainer, path):
  exports.append(path)
  if point == "writing" and len(exports) == 2:
    os.kill(os.getpid(), signal.SIGKILL)  # best.json not written yet
  real_save(trainer, path)
def rename(src, dst):
  real_rename(src, dst)
  if point == "swapping" and dst.endswith(".tmp_best.old"):
    os.kill(os.getpid(), signal.SIGKILL)  # best/ moved aside, new not in
best_lib._save_eval_weights = save
os.rename = rename
experiment.run(t._config({model_dir!r}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("point", ["writing", "swapping"])
def test_kill_9_during_a_best_export_keeps_the_previous_best(
    run, tmp_path, point):
  model_dir = tmp_path / "run"
  proc = run_code(_KILL.format(tests=os.path.dirname(__file__), point=point,
                               model_dir=str(model_dir)))
  assert proc.returncode == -9, proc.stderr[-3000:]
  # The first export is what a reader finds, whole.
  first = min(_scalars(model_dir / "eval", "accuracy"))
  folder = best_lib.best_dir(str(model_dir))
  assert os.path.basename(folder) == ("best" if point == "writing"
                                      else ".tmp_best.old")
  with open(os.path.join(folder, "best.json")) as f:
    assert json.load(f)["step"] == first
  assert manager.damage(os.path.join(folder, "ckpt")) is None
  # What the next run does first: the previous best back in place.
  best_lib.recover(str(model_dir))
  assert _best(model_dir)["step"] == first
  assert not [n for n in os.listdir(model_dir) if n.startswith(".tmp_best")]
  # The relaunch ends as the uninterrupted run.
  experiment.run(_config(model_dir))
  assert _best(model_dir)["step"] == _best(run[0])["step"]
  assert _best(model_dir)["value"] == pytest.approx(_best(run[0])["value"])
  assert not [n for n in os.listdir(model_dir) if n.startswith(".tmp")]


@pytest.mark.slow
@pytest.mark.parametrize("flag,fragment", [
    ("--best_metric=accuracy", "best_metric='accuracy'"),
    ("--best_metric=train/loss", "best_metric='train/loss'"),
    ("--best_metric=eval_nosuch/accuracy", "nosuch"),
    ("--best_mode=up", "best_mode"),
    ("--best_min_delta=-1", "best_min_delta=-1"),
    ("--early_stopping_patience=-2", "early_stopping_patience=-2"),
    ("--early_stopping_patience=2", "needs best_metric"),
    ("--early_stopping_start_step=-1", "early_stopping_start_step=-1"),
    ("--restore_best_on_stop", "needs best_metric"),
])
def test_a_bad_best_or_early_stopping_flag_is_one_line(tmp_path, flag,
                                                        fragment):
  model_dir = tmp_path / "run"
  before = snapshot(tmp_path)
  proc = run_script("train.py", "--model=mlp", "--dataset=synthetic",
                    "--train_steps=2", f"--model_dir={model_dir}", flag,
                    check=False)
  assert_one_line_error(proc, "train.py", fragment, unchanged=before)
