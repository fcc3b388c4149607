"""The update is one object per kind, chosen once by the Trainer
(`framework.core.updates`): which kind each run gets, and that a kind of
one's own is one class that the whole step (skip, EMA) goes through."""

import numpy as np
import pytest

import framework
from framework.core import updates
from test_trainer import data, make_trainer, train  # pylint: disable=unused-import


@pytest.mark.parametrize("strategy,kwargs,kind", [
    ("one_device", {}, updates.MergeCallUpdate),
    ("central_storage", {}, updates.MergeCallUpdate),
    ("mirrored", {}, updates.MergeCallUpdate),
    ("mirrored", {"shard_optimizer_state": True}, updates.ShardedUpdate),
])
def test_each_run_gets_its_kind_holding_its_parts(strategy, kwargs, kind):
  trainer = make_trainer(strategy, nan_policy="skip", ema_decay=0.9,
                         **kwargs)
  updater = trainer.updater
  assert type(updater) is kind
  assert updater.ema is trainer.ema and updater.nan_policy == "skip"
  assert updater.optimizer is trainer.optimizer
  if kind is updates.ShardedUpdate:
    assert updater.sharding is trainer.optimizer_sharding
  # What the distribution check puts back after its step includes them.
  state = {id(v) for v in trainer.step_variables()}
  assert {id(v) for v in updater.state_variables()} <= state


class CountingUpdate(updates.MergeCallUpdate):
  """A kind of one's own: the merge_call update, its applications
  counted (as a new kind would change `_apply`)."""

  traced = 0

  def _apply(self, grads, variables, finite, signals):
    CountingUpdate.traced += 1
    return super()._apply(grads, variables, finite, signals)


class CountingTrainer(framework.Trainer):

  def _make_updater(self, **parts):
    return CountingUpdate(self.strategy, **parts)


def test_a_kind_of_ones_own_is_one_class_and_keeps_the_step(data):
  plain = make_trainer("mirrored", ema_decay=0.9, nan_policy="skip")
  weights, _ = train(plain, data, steps=3)
  own = make_trainer("mirrored", ema_decay=0.9, nan_policy="skip",
                     trainer_cls=CountingTrainer)
  own_weights, _ = train(own, data, steps=3)
  assert CountingUpdate.traced >= 1
  for a, b in zip(weights, own_weights):
    np.testing.assert_array_equal(a, b)
  # The EMA and the skip counters still follow each update.
  assert int(own.ema.num_updates.numpy()) == 3
  assert int(own.skipped_steps.numpy()) == 0
  for a, b in zip(plain.ema.averages, own.ema.averages):
    np.testing.assert_array_equal(a.numpy(), b.numpy())
