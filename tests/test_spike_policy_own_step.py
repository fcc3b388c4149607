"""A train_step override under spike_policy: one that calls
apply_gradients without spike_signals is told exactly that (not that it
never calls apply_gradients); one that passes them drops a spike's update."""

import numpy as np
import pytest
import tensorflow as tf

import framework
from framework.errors import ConfigError
from test_spike_policy import _batches, _iterator, _state
from test_trainer import make_trainer


class OwnStep(framework.Trainer):
  """The guide's shape of a train_step override."""

  def __init__(self, *args, signals=True, **kwargs):
    super().__init__(*args, **kwargs)
    self.signals = signals

  def train_step(self, batch):
    x, y = batch
    with tf.GradientTape() as tape:
      loss = self.average(self.loss_fn(y, self.model(x, training=True)))
    grads = self.all_reduce(tape.gradient(
        loss, self.model.trainable_variables))
    grads, grad_norm = self.clip_by_global_norm(grads)
    self.apply_gradients(grads, spike_signals=self.spike_signals(
        loss, grad_norm) if self.signals else None)
    return {"loss": loss}


def test_apply_gradients_without_spike_signals_says_so():
  trainer = make_trainer("one_device", trainer_cls=OwnStep, signals=False,
                         spike_policy="skip", spike_window=3)
  x, y = _batches()
  with pytest.raises(ConfigError, match="without spike_signals"):
    trainer.train(_iterator(trainer, x, y), 2)


def test_an_own_step_with_spike_signals_skips_the_spike():
  x, y = _batches()
  spiked = make_trainer("one_device", trainer_cls=OwnStep,
                        spike_policy="skip", spike_window=3)
  spiked.train(_iterator(spiked, x, y), len(x))
  clean = make_trainer("one_device", trainer_cls=OwnStep)
  clean.train(_iterator(clean, x, y, drop=6), len(x) - 1)
  assert int(spiked.spikes.skipped.numpy()) == 1
  for a, b in zip(_state(spiked), _state(clean)):
    np.testing.assert_array_equal(a, b)
