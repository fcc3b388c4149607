"""lr_schedule=wsd (warmup-stable-decay): the closed form at every boundary,
its config round trip, bad values in one line, and a resume mid-decay equal
to the uninterrupted run."""

import dataclasses
import math

import numpy as np
import pytest
import tensorflow as tf

import framework
from framework import ConfigError
from framework.app import experiment
from framework.core import optimizers
from tests import helpers
from tests.test_bad_input import TINY, model_dir, train_fails  # noqa: F401

PEAK, FLOOR, TOTAL, WARMUP, FRACTION = 0.8, 0.1, 100, 10, 0.3
DECAY_START = TOTAL - 30


def closed_form(step, shape):
  if step < WARMUP:
    return PEAK * (step + 1) / WARMUP
  done = min(max((step - DECAY_START) / 30, 0.0), 1.0)
  if shape == "cosine":
    done = 0.5 * (1 - math.cos(math.pi * done))
  return PEAK + (FLOOR * PEAK - PEAK) * done


def wsd(shape, **kwargs):
  return framework.OptimizerConfig(
      learning_rate=PEAK, schedule="wsd", warmup_steps=WARMUP,
      total_steps=TOTAL, decay_fraction=FRACTION, decay_shape=shape,
      min_lr_ratio=FLOOR, **kwargs)


@pytest.mark.parametrize("shape", ["linear", "cosine"])
def test_every_boundary_is_the_closed_form(shape):
  schedule = optimizers.make_schedule(wsd(shape))
  # Step 0, the end of the warm-up, the stable peak, the start of the decay,
  # mid-decay, its last step, the end and after.
  steps = [0, WARMUP - 1, WARMUP, DECAY_START - 1, DECAY_START,
           DECAY_START + 15, TOTAL - 1, TOTAL, TOTAL + 50]
  got = [float(schedule(step)) for step in steps]
  want = [closed_form(step, shape) for step in steps]
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
  assert got[steps.index(DECAY_START + 15)] == pytest.approx(
      PEAK * (1 + FLOOR) / 2)  # halfway down, either shape
  assert got[-1] == pytest.approx(FLOOR * PEAK)


def test_the_schedule_serialises_and_reads_back():
  schedule = optimizers.make_schedule(wsd("cosine"))
  tail = schedule.after
  again = optimizers.WsdSchedule.from_config(tail.get_config())
  for step in (0, 50, 70, 85, 99, 100):
    assert float(again(step)) == float(tail(step))
  assert schedule.get_config()["warmup_steps"] == WARMUP


@pytest.mark.parametrize("kwargs,fragments", [
    (dict(decay_fraction=0.0), ["decay_fraction=0.0", "(0, 1]"]),
    (dict(decay_fraction=1.5), ["decay_fraction=1.5", "(0, 1]"]),
    # Named as the flag is (--lr_min_ratio), not as the field.
    (dict(min_lr_ratio=float("nan")), ["lr_min_ratio=nan", "[0, 1]"]),
])
def test_bad_fractions(kwargs, fragments):
  with pytest.raises(ConfigError) as error:
    framework.OptimizerConfig(schedule="wsd", **kwargs)
  for fragment in fragments:
    assert fragment in str(error.value)


def test_warmup_and_decay_beyond_the_run():
  with pytest.raises(ConfigError, match=r"warmup_steps=80 .* = 30\) must be "
                     r"<= total_steps=100"):
    optimizers.make_schedule(dataclasses.replace(wsd("linear"),
                                                 warmup_steps=80))


@pytest.mark.parametrize("flags,fragments", [
    (["--decay_fraction=0"], ["decay_fraction=0", "(0, 1]"]),
    (["--decay_fraction=1.2"], ["decay_fraction=1.2", "(0, 1]"]),
    (["--warmup_steps=2", "--decay_fraction=0.5"],
     ["warmup_steps=2", "must be <= total_steps=2"]),
    (["--decay_shape=square"], ["decay_shape", "square", "cosine"]),
])
def test_train_py_bad_values_are_one_line(model_dir, flags, fragments):  # noqa: F811
  train_fails(model_dir, *TINY, "--lr_schedule=wsd", *flags,
              fragments=fragments)


def _run(model_dir, train_steps, rates):
  config = helpers.tiny_mlp_config(
      model_dir, train_steps=train_steps,
      optimizer=dataclasses.replace(
          wsd("cosine"), learning_rate=0.01, total_steps=20, warmup_steps=4,
          decay_fraction=0.5),
      loop=framework.LoopConfig(train_steps=1, steps_per_loop=1,
                                summary_every=0, log_every=0,
                                checkpoint_every=0))
  experiment.run(config, train_actions=[
      lambda step, outputs: rates.update({step: outputs["learning_rate"]})])


def _checkpoint(model_dir):
  reader = tf.train.load_checkpoint(str(model_dir))
  return {key: reader.get_tensor(key)
          for key in reader.get_variable_to_shape_map()
          if key.startswith(("model/", "optimizer/"))}


def test_a_resume_mid_decay_equals_the_straight_run(tmp_path):
  straight, resumed = {}, {}
  _run(tmp_path / "straight", 20, straight)
  _run(tmp_path / "resumed", 13, resumed)  # stops 3 steps into the decay
  _run(tmp_path / "resumed", 20, resumed)
  assert set(straight) == set(resumed) == set(range(1, 21))
  for step, rate in straight.items():
    assert resumed[step] == rate, step
  a, b = _checkpoint(tmp_path / "straight"), _checkpoint(tmp_path / "resumed")
  assert a.keys() == b.keys() and len(a) > 4
  for key in a:
    np.testing.assert_array_equal(a[key], b[key], err_msg=key)
