"""A checkpoint written by any layout restores into any other.

The layouts (`LAYOUTS`, one list: a new way of writing checkpoints is one
more entry) train the same tiny GPT, at a size and seed no other test uses,
for STEPS steps, each once (a module cache). Then:

- `evaluate.py` (one process) gives each layout's checkpoint the loss the
  one-device run's has, and the checkpoints hold the same weights and
  slots (a split run equals the unsplit one: a layout that wrote or read
  other values, or under other keys, fails here);
- a sample of (writer, reader) pairs resumes the writer's run folder in the
  reader's layout for one more step, and lands on the weights of one
  continuous one-device run of STEPS + 1 steps.

The corpus is the test's own (a few kilobytes of text: `evaluate.py` reads
its whole test split in one batch).

Layouts that start several processes are slow.
"""

import glob
import os
import shutil
import subprocess
from typing import NamedTuple

import numpy as np
import pytest

from framework.core.checkpoints import manager
from framework.errors import CheckpointError
from tests import helpers
from tests.cluster_utils import ENV, LAUNCH, ROOT, model_weights, train_command

GPT = ["--model=gpt", "--dataset=text", "--global_batch_size=8",
       "--sequence_length=12", "--model_width=24", "--num_heads=4",
       "--num_layers=2", "--optimizer=momentum", "--momentum=0.9",
       "--learning_rate=0.05", "--seed=61", "--steps_per_loop=1",
       "--noexport_saved_model"]
# The final evaluation of a training run: one batch (a mirrored GPT's
# --eval_steps=1 ends its eval with an OutOfRangeError traceback: two).
ONE_EVAL_BATCH = "--eval_steps=1"
STEPS = 3
TOLERANCE = 1e-5
CLUSTER = ["--mesh=data:2,model:2", "--model_parallel_devices=cluster",
           "--cpu_devices=2"]


class Layout(NamedTuple):
  name: str
  flags: tuple
  processes: int = 1  # worker processes (launch.py --workers)


LAYOUTS = [
    Layout("one_device", (ONE_EVAL_BATCH,)),
    Layout("mirrored", ("--strategy=mirrored", "--cpu_devices=2",
                        "--eval_steps=2")),
    Layout("mesh", ("--mesh=data:2,model:2", "--cpu_devices=4",
                    ONE_EVAL_BATCH)),
    Layout("mesh_processes", (*CLUSTER, ONE_EVAL_BATCH), processes=2),
    Layout("by_task", (*CLUSTER, "--checkpoint_sharding=by_task",
                       ONE_EVAL_BATCH), processes=2),
    Layout("background", ("--async_checkpoint", ONE_EVAL_BATCH)),
]
BY_NAME = {layout.name: layout for layout in LAYOUTS}


def _param(*names):
  """A test parameter of `names`, slow if any layout starts processes."""
  slow = any(BY_NAME[n].processes > 1 for n in names)
  return pytest.param(*names, marks=[pytest.mark.slow] if slow else [],
                      id="-".join(names))


def _train(layout, model_dir, steps, data_dir):
  args = [*GPT, *layout.flags, f"--model_dir={model_dir}",
          f"--data_dir={data_dir}", f"--train_steps={steps}"]
  if layout.processes == 1:
    proc = helpers.run_script("train.py", *args, timeout=900, check=False)
  else:
    proc = subprocess.run(
        [*LAUNCH, f"--workers={layout.processes}", "--grace_period=2", "--",
         *train_command(), *args], capture_output=True, text=True,
        timeout=900, cwd=ROOT, env=ENV)
  assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
  return proc


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  """A corpus of its own: train/ and test/ text, a few kilobytes."""
  root = tmp_path_factory.mktemp("corpus")
  rng = np.random.default_rng(61)
  words = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta"]
  for split, size in (("train", 600), ("test", 120)):
    os.makedirs(root / split)
    text = " ".join(rng.choice(words, size=size))
    (root / split / f"{split}.txt").write_text(text + "\n")
  return str(root)


@pytest.fixture(scope="module")
def written(tmp_path_factory, corpus):
  """name -> the run folder of that layout's STEPS steps, trained on first
  use (a fast test never starts the processes a slow layout needs)."""
  runs = {}

  def run(name):
    if name not in runs:
      model_dir = str(tmp_path_factory.mktemp(name) / "run")
      _train(BY_NAME[name], model_dir, STEPS, corpus)
      runs[name] = model_dir
    return runs[name]
  return run


@pytest.fixture(scope="module")
def continuous(tmp_path_factory, corpus):
  """One device, STEPS + 1 steps uninterrupted: where every resume lands."""
  model_dir = str(tmp_path_factory.mktemp("continuous") / "run")
  _train(BY_NAME["one_device"], model_dir, STEPS + 1, corpus)
  return model_weights(model_dir)


@pytest.fixture(scope="module")
def evaluated():
  """model_dir -> evaluate.py's metrics of its latest checkpoint (each run
  folder evaluated once; the whole test split, in one batch of 512)."""
  metrics = {}

  def evaluate(model_dir):
    if model_dir not in metrics:
      proc = helpers.run_script("evaluate.py", f"--model_dir={model_dir}",
                                "--global_batch_size=512", timeout=900)
      metrics[model_dir] = helpers.printed_metrics(proc.stdout)
    return metrics[model_dir]
  return evaluate


def _assert_close(weights, expected):
  assert weights and weights.keys() == expected.keys()
  for key, value in expected.items():
    # Relative to the tensor's largest value, but no finer than 1e-3: a
    # bias whose gradient is zero but for rounding (attention's key bias)
    # stays near 1e-11, where replicas round differently.
    scale = max(float(np.max(np.abs(value))), 1e-3)
    difference = float(np.max(np.abs(weights[key] - value))) / scale
    assert difference <= TOLERANCE, (key, difference)


@pytest.mark.parametrize("name", [_param(layout.name) for layout in LAYOUTS])
def test_evaluate_gives_every_layouts_checkpoint_the_same_loss(
    written, evaluated, name):
  model_dir = written(name)
  reference = written("one_device")
  loss = evaluated(model_dir)["loss"]
  expected = evaluated(reference)["loss"]
  assert abs(loss - expected) <= TOLERANCE * abs(expected), (loss, expected)
  _assert_close(model_weights(model_dir), model_weights(reference))


# (writer, reader): each layout writes and reads at least once; the
# per-host shards both ways across a change of process count.
PAIRS = [("mirrored", "mesh"), ("mesh", "one_device"),
         ("by_task", "one_device"), ("one_device", "by_task"),
         ("mesh_processes", "by_task"), ("by_task", "mirrored"),
         ("background", "mesh"), ("mirrored", "background")]


@pytest.mark.parametrize("writer,reader", [_param(*p) for p in PAIRS])
def test_a_checkpoint_resumes_in_another_layout(written, continuous, corpus,
                                                tmp_path, writer, reader):
  model_dir = str(tmp_path / "run")
  shutil.copytree(written(writer), model_dir)
  _train(BY_NAME[reader], model_dir, STEPS + 1, corpus)
  assert os.path.exists(os.path.join(model_dir, f"ckpt-{STEPS + 1}.index"))
  _assert_close(model_weights(model_dir), continuous)


@pytest.mark.slow
def test_a_missing_task_file_of_a_per_host_checkpoint_is_named(written,
                                                               tmp_path):
  """Each worker's data file is part of the checkpoint the integrity check
  reads: one missing is named, never a silent partial restore."""
  model_dir = str(tmp_path / "run")
  shutil.copytree(written("by_task"), model_dir)
  prefix = os.path.join(model_dir, f"ckpt-{STEPS}")
  data = sorted(glob.glob(prefix + ".data-*"))
  assert len(data) >= 2, data  # the chief's and the worker's
  biggest = max(data, key=os.path.getsize)  # the worker's shards
  os.remove(biggest)
  assert manager.damage(prefix) == f"{biggest} is missing"
  with pytest.raises(CheckpointError, match="no intact checkpoint"):
    manager.latest_intact(model_dir)
