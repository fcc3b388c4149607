"""Activation recomputation without a split (`--recompute=blocks|attention|every:K`)."""

import os

from absl import flags
import h5py
import numpy as np
import pytest

from framework.errors import ConfigError
from framework.model_parallel.config import ModelParallelConfig, parse_recompute
from scripts import config_flags
from tests import helpers

# A size and seed of this file's own.
GPT = ["--model=gpt", "--dataset=text", "--global_batch_size=6",
       "--sequence_length=12", "--model_width=24", "--num_heads=2",
       "--num_layers=3", "--seed=1357", "--train_steps=3",
       "--optimizer=momentum", "--learning_rate=0.05"]
# The GPT runs compare weights: two evaluation batches (a mirrored GPT's
# --eval_steps=1 ends its eval with an OutOfRangeError) and no SavedModel
# (evaluating the whole text test set and exporting were ~20 s of a
# one-device run's ~25 s; a failing export is only a warning anyway).
FAST = ["--eval_steps=2", "--export_saved_model=false"]
MLP = ["--model=mlp", "--dataset=synthetic", "--hidden_units=24,20,16",
       "--global_batch_size=12", "--seed=1357", "--train_steps=3",
       "--optimizer=momentum", "--learning_rate=0.05"]


def _flag(*args):
  values = flags.FlagValues()
  config_flags.define_flags(values)
  values(["train.py", "--train_steps=1", *args])
  return values["recompute"].value


def test_the_boolean_spellings_keep_their_meaning():
  # --recompute, --norecompute, --recompute=true|false: as before.
  assert _flag() is False
  assert _flag("--recompute") is True
  assert _flag("--norecompute") is False
  assert _flag("--recompute=true") is True
  assert _flag("--recompute=false") is False
  assert _flag("--recompute=none") is False
  assert _flag("--recompute=every:03") == "every:3"
  assert ModelParallelConfig(mode="pipeline", recompute=True).recompute is True
  assert ModelParallelConfig(recompute=False).recompute is False
  # True still means a split's stages: without a split, an error.
  with pytest.raises(ConfigError, match="recompute re-runs"):
    ModelParallelConfig(recompute=True)
  assert ModelParallelConfig(recompute="blocks").recompute == "blocks"


@pytest.mark.parametrize("value", ["every:0", "every:x", "every:", "all",
                                   "every:\u0663"])  # an Arabic-Indic 3
def test_a_bad_value_names_it(value):
  with pytest.raises(ConfigError, match="recompute="):
    parse_recompute(value)


def test_recomputed_segments_run_their_forward_again():
  """The gradient's graph holds a second forward pass of each segment."""
  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import models  # pylint: disable=g-import-not-at-top
  from framework.model_parallel import recompute  # pylint: disable=g-import-not-at-top

  def softmaxes(value):
    with recompute.policy(value) as declared:
      model = models.build_model("gpt", (8,), 32, num_layers=2, num_heads=2,
                                 model_width=16)
    recompute.apply(model, value, declared)
    x = tf.zeros((2, 8), tf.int32)

    @tf.function
    def step():
      with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(x, training=True))
      return tape.gradient(loss, model.trainable_variables)

    graph = step.get_concrete_function().graph
    return sum(op.type == "Softmax" for op in _all_ops(graph))

  assert softmaxes(False) == 2
  for value in ("blocks", "attention", "every:2"):
    assert softmaxes(value) == 4, value
  keras.backend.clear_session()


def _all_ops(graph):
  yield from graph.get_operations()
  for function in graph._functions.values():  # pylint: disable=protected-access
    inner = getattr(function, "graph", None)
    if inner is not None:
      yield from _all_ops(inner)


def _train(model_dir, *args, check=True):
  return helpers.run_script("train.py", f"--model_dir={model_dir}", *args,
                            check=check)


def _weights(model_dir):
  with h5py.File(os.path.join(model_dir, "model.weights.h5")) as f:
    arrays = []
    f.visititems(lambda name, obj: arrays.append((name, obj[()]))
                 if isinstance(obj, h5py.Dataset) else None)
  return dict(arrays)


def _assert_close(a, b):
  assert a.keys() == b.keys()
  for name in a:
    np.testing.assert_allclose(a[name], b[name], atol=1e-6, rtol=0,
                               err_msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("setup", [
    ["--strategy=one_device"],
    ["--strategy=mirrored", "--cpu_devices=2"],
])
def test_gpt_recomputed_equals_not_recomputed(tmp_path, setup):
  _train(tmp_path / "none", *GPT, *FAST, *setup, "--recompute=none")
  reference = _weights(tmp_path / "none")
  # Every value on one device; on 2 replicas the blocks only: attention is
  # the same segment code one layer down, and every:K on 2 replicas is
  # test_functional_model_every_k_equals_not_recomputed's.
  values = (("blocks", "attention", "every:2")
            if "--strategy=one_device" in setup else ("blocks",))
  for value in values:
    _train(tmp_path / value, *GPT, *FAST, *setup, f"--recompute={value}")
    _assert_close(_weights(tmp_path / value), reference)


@pytest.mark.slow
def test_gpt_on_a_mesh_recomputed_equals_not_recomputed(tmp_path):
  mesh = ["--mesh=data:1,model:2", "--cpu_devices=2"]
  _train(tmp_path / "none", *GPT, *FAST, *mesh)
  reference = _weights(tmp_path / "none")
  for value in ("blocks", "attention"):
    _train(tmp_path / value, *GPT, *FAST, *mesh, f"--recompute={value}")
    _assert_close(_weights(tmp_path / value), reference)


@pytest.mark.slow
def test_functional_model_every_k_equals_not_recomputed(tmp_path):
  for setup in (["--strategy=one_device"],
                ["--strategy=mirrored", "--cpu_devices=2"]):
    _train(tmp_path / "none", *MLP, *setup)
    reference = _weights(tmp_path / "none")
    _train(tmp_path / "every", *MLP, *setup, "--recompute=every:2")
    _assert_close(_weights(tmp_path / "every"), reference)
    for run in ("none", "every"):
      for name in os.listdir(tmp_path / run):
        path = tmp_path / run / name
        if path.is_file():
          path.unlink()


@pytest.mark.slow
@pytest.mark.parametrize("args,fragment", [
    (MLP + ["--recompute=every:0"], "every:0"),
    (MLP + ["--recompute=every:x"], "every:x"),
    (MLP + ["--recompute=blocks"], "recompute=blocks"),
    (GPT + ["--recompute=every:2", "--mesh=data:1,model:2",
            "--cpu_devices=2"], "recompute=every:2"),
])
def test_a_bad_value_is_one_line_and_leaves_the_model_dir(tmp_path, args,
                                                          fragment):
  model_dir = tmp_path / "run"
  model_dir.mkdir()
  (model_dir / "keep.txt").write_text("mine")
  before = helpers.snapshot(str(model_dir))
  proc = _train(model_dir, *args, check=False)
  helpers.assert_one_line_error(proc, "train.py", fragment, unchanged=before)


# Five steps with checkpoints at 2 and 4; the runs below resume from one of
# them and end at the weights of one uninterrupted run of these.
LONGER = [a for a in GPT if not a.startswith("--train_steps")] + FAST + [
    "--train_steps=5", "--checkpoint_every=2", "--steps_per_loop=1"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
  """The weights of the uninterrupted LONGER run (not recomputed)."""
  model_dir = tmp_path_factory.mktemp("straight")
  _train(model_dir, *LONGER)
  return _weights(model_dir)


@pytest.mark.slow
def test_resume_across_on_and_off_equals_an_uninterrupted_run(tmp_path,
                                                              straight):
  _train(tmp_path / "mixed", *LONGER, "--train_steps=2",
         "--recompute=blocks")
  _train(tmp_path / "mixed", *LONGER)
  _assert_close(_weights(tmp_path / "mixed"), straight)


# train.py whose GPT run kills itself (-9) inside step KILL_AT_STEP + 1.
KILLED_GPT = """
import os, signal, sys
sys.path.insert(0, {root!r})
import tensorflow as tf
from absl import app
from framework.tasks.language_model import LanguageModelTrainer
from scripts import cli, train

KILL_AT = int(os.environ.get("KILL_AT_STEP", "-1"))

def kill_at(step):
  if step == KILL_AT:
    os.kill(os.getpid(), signal.SIGKILL)
  return step

class Killed(LanguageModelTrainer):
  def compute_gradients(self, batch):
    grads, metrics = super().compute_gradients(batch)
    step = tf.numpy_function(kill_at, [self.global_step], tf.int64)
    with tf.control_dependencies([step]):
      return [tf.identity(g) for g in grads], metrics

app.run(cli.main_running(lambda: train.run_main(Killed)))
"""


@pytest.mark.slow
@pytest.mark.parametrize("relaunch", ["blocks", "none"])
def test_kill_9_with_recompute_then_relaunch_equals_an_uninterrupted_run(
    tmp_path, relaunch, straight):
  """Killed mid-run with --recompute=attention; relaunched with it (or with
  another value) from checkpoint 2: the uninterrupted run's weights."""
  script = tmp_path / "killed_gpt.py"
  script.write_text(KILLED_GPT.format(root=helpers.ROOT))
  run = f"--model_dir={tmp_path / 'run'}"
  killed = helpers.run_script(str(script), run, *LONGER,
                              "--recompute=attention", check=False,
                              env={"KILL_AT_STEP": "3"})
  assert killed.returncode in (-9, 137), killed.stderr[-2000:]
  assert not (tmp_path / "run" / "model.weights.h5").exists()
  done = helpers.run_script(str(script), run, *LONGER,
                            f"--recompute={relaunch}")
  assert "Restored checkpoint" in done.stderr
  _assert_close(_weights(tmp_path / "run"), straight)
