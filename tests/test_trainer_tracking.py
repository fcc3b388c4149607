"""A trainer with several models: extra models, optimizers and variables
(tf.Variable, keras.Variable, or lists, tuples and dicts of them) a Trainer
subclass creates go under `self.strategy.scope()` and `self.track(...)`,
are checkpointed by name and restored; one created outside the scope, an
unbuilt optimizer, one left untracked, a name the checkpoint itself uses
or a value no checkpoint can hold is refused in one line (before anything
is written to model_dir); the distillation and GAN ports resume after
kill -9 exactly as an uninterrupted run, on one device and on mirrored."""

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
from framework.core import checkpoints, precision
from framework.core.checkpoints import manager
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


class Counting(framework.Trainer):
  """Tracks a tf.Variable that counts its steps, a keras.Variable and a
  list of a teacher and its built optimizer, all made under the scope;
  `seed` sets the teacher's and the keras.Variable's first values."""

  seed = 1
  instances = []

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    with self.strategy.scope():
      self.steps_seen = tf.Variable(
          0, dtype=tf.int64,
          aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
      self.scale = keras.Variable(float(self.seed))
      teacher = _dense(self.seed)
      teacher_optimizer = keras.optimizers.SGD(0.1)
      teacher_optimizer.build(teacher.trainable_variables)
    self.pair = [teacher, teacher_optimizer]
    self.track(steps_seen=self.steps_seen, scale=self.scale, pair=self.pair)
    Counting.instances.append(self)

  def compute_loss(self, batch):
    self.steps_seen.assign_add(1)
    return super().compute_loss(batch)


class CountingSeed2(Counting):
  seed = 2


def _run(model_dir, trainer_cls, train_steps):
  config = framework.ExperimentConfig(
      dataset="synthetic", model="mlp", model_dir=str(model_dir),
      strategy="mirrored", global_batch_size=8, train_steps=train_steps,
      export_saved_model=False)
  experiment.run(config, trainer_cls=trainer_cls, strategy=mirrored())
  return Counting.instances[-1]


def test_tracked_variables_and_a_list_resume_with_the_run(tmp_path):
  """tf.Variable, keras.Variable and a [model, optimizer] list made under
  mirrored's scope: in the checkpoint, and restored by the resumed run
  (which made them with other values)."""
  first = _run(tmp_path, Counting, train_steps=2)
  assert int(first.steps_seen.numpy()) == 2
  saved = dict(tf.train.list_variables(str(tmp_path)))
  assert "steps_seen/.ATTRIBUTES/VARIABLE_VALUE" in saved
  assert "scale/.ATTRIBUTES/VARIABLE_VALUE" in saved
  assert any(key.startswith("pair/") for key in saved)
  teacher = [w.numpy() for w in first.pair[0].weights]
  resumed = _run(tmp_path, CountingSeed2, train_steps=3)
  assert int(resumed.steps_seen.numpy()) == 3  # 2 restored, then 1 step
  assert float(resumed.scale.numpy()) == 1.0
  assert not np.array_equal(_dense(2).weights[0].numpy(), teacher[0])
  for a, b in zip(teacher, resumed.pair[0].weights):
    np.testing.assert_array_equal(a, b.numpy())


def _trainer(strategy=None):
  return framework.Trainer(*_student(strategy or mirrored()),
                           strategy or mirrored(), global_batch_size=4)


def _outside_scope():
  return {"tf_variable": tf.Variable(1.0),
          "keras_variable": keras.Variable(1.0),
          "pair": [_dense(1), keras.optimizers.SGD(0.1)]}


@pytest.mark.parametrize("name,message", [
    ("tf_variable", "Trainer.track(tf_variable=...): its variable "),
    ("keras_variable", "Trainer.track(keras_variable=...): its variable "),
    ("pair", "Trainer.track(pair=...): pair[0]: its variable "),
])
def test_a_variable_made_outside_the_scope_is_one_line(name, message):
  trainer = _trainer()
  with pytest.raises(framework.ConfigError) as e:
    trainer.track(**{name: _outside_scope()[name]})
  assert message in str(e.value) and "\n" not in str(e.value)
  assert "created outside strategy.scope()" in str(e.value)
  assert trainer.tracked_objects == {}


def test_an_unbuilt_optimizer_in_a_list_is_one_line():
  trainer = _trainer()
  with mirrored().scope():
    teacher, optimizer = _dense(1), keras.optimizers.SGD(0.1)
  with pytest.raises(framework.ConfigError,
                     match=r"^Trainer.track\(pair=...\): pair\[1\] is not "
                     r"built; call pair\[1\].build\(variables\)"):
    trainer.track(pair=[teacher, optimizer])


@pytest.mark.parametrize("name", ["restore", "save_counter", "save", "write",
                                  "_saver", "model", "global_step",
                                  "rng_states", "ema", "loss_scale"])
def test_a_name_the_checkpoint_uses_is_one_line(name):
  trainer = _trainer()
  with mirrored().scope():
    value = tf.Variable(1.0)
  with pytest.raises(framework.ConfigError) as e:
    trainer.track(**{name: value})
  text = str(e.value)
  assert text.startswith(f"Trainer.track({name}=...): {name!r} is a name ")
  assert "choose another" in text and "\n" not in text


@pytest.mark.parametrize("value,kind", [
    (3, "int"), ("teacher", "str"), (np.zeros(3), "numpy.ndarray"),
    (_dense, "function"), ([3], "int"), ({"a": 3}, "int")])
def test_a_value_no_checkpoint_holds_is_one_line_naming_its_type(value, kind):
  trainer = _trainer()
  with pytest.raises(framework.ConfigError) as e:
    trainer.track(x=value)
  text = str(e.value)
  assert text.startswith("Trainer.track(x=...): ") and "\n" not in text
  assert f"has type {kind}, which a checkpoint cannot hold" in text


def test_a_dict_key_that_is_no_string_is_one_line():
  with mirrored().scope():
    value = tf.Variable(1.0)
  with pytest.raises(framework.ConfigError,
                     match=r"^Trainer.track\(x=...\): x has the key 0, an? "
                     r"int; .* must be strings$"):
    _trainer().track(x={0: value})


class InAList(framework.Trainer):

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    with self.strategy.scope():
      self.teachers = [_dense(1)]


def test_a_model_in_an_untracked_list_attribute_is_one_line():
  trainer = InAList(*_student(mirrored()), mirrored(), global_batch_size=4)
  with pytest.raises(framework.ConfigError, match=(
      r"^InAList.teachers\[0\] \(a keras.Model\) is not checkpointed: .* "
      r"self.track\(teachers=self.teachers\)$")):
    checkpoints.checkpoint_objects(trainer)
  trainer.track(teachers=trainer.teachers)
  assert checkpoints.checkpoint_objects(trainer)["teachers"] is (
      trainer.teachers)


def test_the_reserved_names_cover_every_name_distloop_checkpoints():
  """A trainer with a loss scale and an EMA: every name its checkpoint
  holds is reserved (OWN_NAMES kept up to date)."""
  strategy = mirrored()
  model, optimizer = _student(strategy)
  model.add(keras.layers.Dropout(0.5, seed=1))  # a seed generator's state
  trainer = framework.Trainer(
      model, optimizer, strategy, global_batch_size=4, ema_decay=0.9,
      loss_scale=precision.LossScale(strategy))
  items = checkpoints.checkpoint_items(trainer)
  names = set(checkpoints.checkpoint_objects(trainer, items))
  assert {"loss_scale", "ema", "rng_states"} <= names
  assert names <= set(manager.OWN_NAMES) <= manager.reserved_names()


# A custom step run as an app (train.py's flags): it counts its steps in a
# tracked tf.Variable named --track_name.
_COUNTING_APP = """
from distloop_cli import cli
cli.quiet_startup()
cli.import_tensorflow_quietly()
from absl import flags
import tensorflow as tf
import framework
from distloop_cli import train

NAME = flags.DEFINE_string("track_name", "counter", "the tracked name")


class CountingTrainer(framework.Trainer):

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    with self.strategy.scope():
      self.counter = tf.Variable(
          0, dtype=tf.int64,
          aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
    self.track(**{NAME.value: self.counter})

  def compute_loss(self, batch):
    self.counter.assign_add(1)
    return super().compute_loss(batch)


if __name__ == "__main__":
  cli.run_app(lambda argv: train.run_main(trainer_cls=CountingTrainer))
"""


@pytest.mark.slow
def test_a_custom_step_app_resumes_its_tracked_variable(tmp_path):
  """Stopped at step 2 and relaunched to 4: the counter restored (4, not
  2); tracked as `restore` it is one line and no model_dir."""
  app = tmp_path / "counting.py"
  app.write_text(_COUNTING_APP)
  model_dir = tmp_path / "run"
  common = ["--model=mlp", "--hidden_units=8", "--dataset=synthetic",
            "--strategy=mirrored", "--cpu_devices=2", "--global_batch_size=8",
            "--eval_steps=1", "--export_saved_model=false",
            f"--model_dir={model_dir}"]
  for steps in (2, 4):
    proc = helpers.run_python(str(app), *common, f"--train_steps={steps}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert tf.train.load_variable(
        str(model_dir), "counter/.ATTRIBUTES/VARIABLE_VALUE") == steps
  refused = tmp_path / "refused"
  proc = helpers.run_python(str(app), *common, "--track_name=restore",
                            f"--model_dir={refused}", "--train_steps=2")
  assert proc.returncode == 1
  errors = [line for line in proc.stderr.splitlines() if ": error: " in line]
  assert len(errors) == 1, proc.stderr[-3000:]
  assert errors[0].startswith("counting.py: error: CountingTrainer.track("
                              "restore=...): 'restore' is a name ")
  assert not refused.exists()


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
