"""A fresh Controller evaluates what it holds (Orbit's semantics): without
a checkpoint, the model's current weights at the current global_step; and
`steps_per_loop` may be a function of the global step."""

import dataclasses
import os

import numpy as np
import pytest

import framework
from test_controller import eval_input, make_controller, scalars


def test_a_fresh_controller_without_a_checkpoint_evaluates_its_weights(
    tmp_path):
  controller = make_controller(tmp_path, 12)
  trainer = controller.trainer
  # A model set up in Python (e.g. loaded weights) at a step of its own.
  trainer.model.set_weights([w + 0.25 for w in trainer.model.get_weights()])
  trainer.global_step.assign(7)
  results = controller.evaluate()
  direct = trainer.evaluate(trainer.strategy.experimental_distribute_dataset(
      eval_input()))
  assert results["examples"] == 40 == direct["examples"]
  for name in ("loss", "mae"):
    assert results[name] == pytest.approx(direct[name], rel=1e-6)
  assert scalars(str(tmp_path / "eval"), "mae") == pytest.approx({7: results[
      "mae"]})
  # Evaluating wrote no checkpoint and left the weights as they were.
  assert controller.restored_from is None and controller.step == 7
  assert not [n for n in os.listdir(tmp_path) if n.startswith("ckpt-")]
  # With a checkpoint it evaluates that, at its step (as before).
  make_controller(tmp_path / "run", 4).run()
  fresh = make_controller(tmp_path / "run", 4)
  again = fresh.evaluate()
  assert fresh.step == 4 and fresh.restored_from.endswith("ckpt-4")
  assert sorted(scalars(str(tmp_path / "run" / "eval"), "mae")) == [4]
  assert np.isfinite(again["loss"])


def test_steps_per_loop_may_be_a_function_of_the_global_step(tmp_path):
  controller = make_controller(tmp_path, 10)
  controller.config = dataclasses.replace(
      controller.config, summary_every=0, log_every=0, checkpoint_every=0,
      steps_per_loop=lambda step: 2 if step < 4 else 3)
  ends = []
  controller.train_actions.append(lambda step, outputs: ends.append(step))
  controller.run()
  assert ends == [2, 4, 7, 10]
  bad = make_controller(tmp_path / "bad", 4)
  bad.config = dataclasses.replace(bad.config, steps_per_loop=lambda s: 0)
  with pytest.raises(framework.ConfigError,
                     match=r"steps_per_loop\(0\) returned 0"):
    bad.run()
  with pytest.raises(framework.ConfigError, match="steps_per_loop"):
    framework.LoopConfig(train_steps=4, steps_per_loop=0)
