"""The distribution check runs the training loop's own step (`run_step`),
not a copy of it: a change to the step or to the loop around it (how the
metrics are summed, how often a batch is stepped) is what the check sees.
Runs on the 2 logical CPU devices of tests/conftest.py."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import framework
from framework.check import distribution_check
from framework.core import trainer as trainer_lib
from framework.core.trainer import Trainer

GLOBAL_BATCH = 16


def build_mlp():
  return keras.Sequential([
      keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
      keras.layers.Dense(4)])


@pytest.fixture(scope="module")
def batch():
  rng = np.random.default_rng(0)
  return (rng.normal(size=(GLOBAL_BATCH, 8)).astype(np.float32),
          rng.integers(0, 4, GLOBAL_BATCH).astype(np.int32))


@pytest.fixture(scope="module")
def mirrored():
  strategy = framework.make_strategy("mirrored")
  assert strategy.num_replicas_in_sync == 2
  return strategy


def check(strategy, batch, **kwargs):
  return distribution_check.check_trainer_class(
      Trainer, build_mlp, lambda: keras.optimizers.SGD(0.1), strategy, batch,
      global_batch_size=GLOBAL_BATCH, print_fn=None, **kwargs)


def test_the_check_traces_the_loops_step_on_both_sides(batch, mirrored,
                                                       monkeypatch):
  traced = []
  original = trainer_lib.StepLoop.run_step

  def recording(self, dist_batch):
    traced.append(self.strategy.num_replicas_in_sync)
    return original(self, dist_batch)

  monkeypatch.setattr(trainer_lib.StepLoop, "run_step", recording)
  report = check(mirrored, batch)
  assert report.verdict == "pass", report.table()
  # One device twice (the batch, and reversed), then the 2 replicas.
  assert sorted(set(traced)) == [1, 2], traced


def test_a_loop_reporting_the_mean_of_the_shares_fails(batch, mirrored,
                                                       monkeypatch):
  # The step is right; the loop around it reports 1/N of each metric. A
  # check summing the shares itself would pass it.
  def mean(self, per_replica):
    return {k: self.strategy.reduce(tf.distribute.ReduceOp.MEAN, v,
                                    axis=None)
            for k, v in per_replica.items()}

  monkeypatch.setattr(trainer_lib.StepLoop, "_reduce", mean)
  report = check(mirrored, batch)
  assert report.verdict == "fail", report.table()
  bad = {r.name for r in report.rows if not r.ok}
  assert bad == {"loss", "accuracy", "grad_norm"}, report.table()
  assert all(r.ok for r in report.rows if r.section != "metric")


def test_a_loop_stepping_each_batch_twice_fails(batch, mirrored, monkeypatch):
  original = trainer_lib.StepLoop.run_step

  def twice(self, dist_batch):
    original(self, dist_batch)
    return original(self, dist_batch)

  monkeypatch.setattr(trainer_lib.StepLoop, "run_step", twice)
  report = check(mirrored, batch)
  assert "optimizer_steps" in report.cause_codes, report.table()
  assert "2 times on 2 replicas and 2 times on one device" in (
      report.table())


def test_the_trainers_step_math_changed_is_seen(batch, mirrored,
                                                monkeypatch):
  # Trainer.train_step with its clip moved before the all-reduce: the
  # check runs the trainer's step as it is now.
  def clip_first(self, batch):
    grads, metrics = self.accumulate_gradients(batch)
    grads, grad_norm = self.clip_by_global_norm(grads)
    self.apply_gradients(self.unscale(self.all_reduce(grads)))
    return {**metrics, "grad_norm": self.replica_share(grad_norm)}

  assert check(mirrored, batch, clip_norm=1e-2).verdict == "pass"
  monkeypatch.setattr(Trainer, "train_step", clip_first)
  report = check(mirrored, batch, clip_norm=1e-2)
  # grad_norm, now the norm of a share, differs too.
  assert report.cause_codes == ["clip_before_reduce", "metric_mismatch"], (
      report.table())


def test_what_a_step_changes_is_put_back(batch, mirrored):
  # The trainer's own step_variables(): the EMA, the skip counters and the
  # global step too, not only the model and the optimizer.
  with mirrored.scope():
    model, optimizer = build_mlp(), keras.optimizers.Adam(1e-3)
  trainer = Trainer(model, optimizer, mirrored,
                    global_batch_size=GLOBAL_BATCH, ema_decay=0.9,
                    nan_policy="skip")
  trainer.global_step.assign(7)
  state = trainer.step_variables()
  assert {id(trainer.global_step), id(trainer.ema.num_updates)} <= {
      id(v) for v in state}
  before = [v.numpy().copy() for v in state]

  def reference():
    one = framework.make_strategy("one_device")
    with one.scope():
      return Trainer(build_mlp(), keras.optimizers.Adam(1e-3), one,
                     global_batch_size=GLOBAL_BATCH, ema_decay=0.9,
                     nan_policy="skip")

  report = distribution_check.check_distribution(trainer, reference, batch,
                                                 print_fn=None)
  assert report.verdict == "pass", report.table()
  for v, old in zip(trainer.step_variables(), before):
    np.testing.assert_array_equal(v.numpy(), old, err_msg=v.name)
  assert int(trainer.global_step.numpy()) == 7
