"""A trainer with several models: extra models and optimizers a Trainer
subclass creates go under `self.strategy.scope()` and `self.track(...)`,
are checkpointed by name and restored; one created outside the scope, an
unbuilt optimizer, or one left untracked is refused in one line (before
anything is written to model_dir); the distillation and GAN ports resume
after kill -9 exactly as an uninterrupted run, on one device and on
mirrored."""

import os
import re
import signal
import subprocess
import sys
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import framework
from framework.app import experiment
from framework.core import checkpoints
import helpers
from helpers import ROOT
from shared_strategy import mirrored
import zygote_client


def _student(strategy):
  with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    optimizer = keras.optimizers.SGD(0.1)
  return model, optimizer


def _dense(seed):
  keras.utils.set_random_seed(seed)
  return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])


class Tracked(framework.Trainer):

  def __init__(self, *args, seed=1, **kwargs):
    super().__init__(*args, **kwargs)
    with self.strategy.scope():
      self.teacher = _dense(seed)
      self.critic_optimizer = keras.optimizers.Adam(1e-3)
      self.critic_optimizer.build(self.teacher.trainable_variables)
    self.track(teacher=self.teacher, critic_optimizer=self.critic_optimizer)


class Untracked(framework.Trainer):

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    with self.strategy.scope():
      self.teacher = _dense(1)


class OutsideScope(framework.Trainer):

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self.teacher = _dense(1)  # not under the strategy
    self.track(teacher=self.teacher)


class Unbuilt(framework.Trainer):

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    with self.strategy.scope():
      self.critic_optimizer = keras.optimizers.Adam(1e-3)
    self.track(critic_optimizer=self.critic_optimizer)


def test_tracked_models_and_optimizers_are_checkpointed_and_restored(
    tmp_path):
  strategy = mirrored()
  first = Tracked(*_student(strategy), strategy, global_batch_size=4, seed=1)
  objects = checkpoints.checkpoint_objects(first)
  assert objects["teacher"] is first.teacher
  assert objects["critic_optimizer"] is first.critic_optimizer
  path = tf.train.Checkpoint(**objects).save(str(tmp_path / "ckpt"))
  second = Tracked(*_student(strategy), strategy, global_batch_size=4,
                   seed=2)
  assert not np.array_equal(first.teacher.weights[0].numpy(),
                            second.teacher.weights[0].numpy())
  tf.train.Checkpoint(**checkpoints.checkpoint_objects(second)).restore(
      path).assert_existing_objects_matched()
  for a, b in zip(first.teacher.weights, second.teacher.weights):
    np.testing.assert_array_equal(a.numpy(), b.numpy())


@pytest.mark.parametrize("cls,message", [
    (Untracked, "Untracked.teacher (a keras.Model) is not checkpointed: "
     "create it in __init__ under `with self.strategy.scope():` and register "
     "it with self.track(teacher=self.teacher)"),
    (OutsideScope, "OutsideScope.track(teacher=...): its variable"),
    (Unbuilt, "Unbuilt.track(critic_optimizer=...): the optimizer is not "
     "built"),
])
def test_an_extra_model_not_declared_is_one_line_before_model_dir(
    tmp_path, cls, message):
  model_dir = tmp_path / "run"
  config = framework.ExperimentConfig(
      dataset="synthetic", model="mlp", model_dir=str(model_dir),
      strategy="mirrored", global_batch_size=8, train_steps=1,
      export_saved_model=False)
  with pytest.raises(framework.ConfigError) as e:
    experiment.run(config, trainer_cls=cls, strategy=mirrored())
  assert message in str(e.value) and "\n" not in str(e.value)
  assert not model_dir.exists()


def _example(example, model_dir, strategy, popen=False):
  """Runs the port to its end (its final weights' sha256), or, with
  `popen`, starts it and returns the process. Forked from the test zygote
  (tests/zygote.py): TensorFlow is imported once, and the process is the
  run itself, so SIGKILL of it is kill -9 of the run."""
  script = os.path.join(ROOT, "scripts", "examples", example)
  args = ["--model=mlp", "--hidden_units=16", "--dataset=synthetic",
          f"--strategy={strategy}", "--cpu_devices=2",
          "--global_batch_size=32", "--train_steps=24", "--steps_per_loop=1",
          "--checkpoint_every=1", "--eval_steps=1",
          "--export_saved_model=false", f"--model_dir={model_dir}"]
  if popen:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    if helpers.needs_fresh_interpreter(args, env):
      return subprocess.Popen([sys.executable, script, *args], env=env,
                              stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    return zygote_client.popen(script, args, cwd=ROOT, env=env,
                               stdout=os.devnull, stderr=os.devnull)
  proc = helpers.run_python(script, *args, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return re.search(r"final weights sha256=(\w+)", proc.stderr).group(1)


@pytest.mark.parametrize("example,strategy", [
    ("distillation.py", "default"),
    pytest.param("distillation.py", "mirrored", marks=pytest.mark.slow),
    pytest.param("gan.py", "default", marks=pytest.mark.slow),
    ("gan.py", "mirrored")])
def test_several_model_trainers_resume_after_kill_9_as_uninterrupted(
    tmp_path, example, strategy):
  """The teacher-student and the GAN port (generator and its optimizer
  tracked): kill -9 after step 2's checkpoint, relaunch, same final
  weights as an uninterrupted run."""
  whole = _example(example, tmp_path / "whole", strategy)
  killed = tmp_path / "killed"
  process = _example(example, killed, strategy, popen=True)
  try:
    deadline = time.time() + 240
    while not (killed / "ckpt-2.index").exists():
      assert process.poll() is None, "the run ended before it was killed"
      assert time.time() < deadline
      time.sleep(0.01)
    process.send_signal(signal.SIGKILL)  # kill -9 mid-run
  finally:
    process.wait()
  assert process.returncode == -signal.SIGKILL
  assert not (killed / "ckpt-24.index").exists()
  assert _example(example, killed, strategy) == whole
