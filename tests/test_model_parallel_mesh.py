"""`--mesh=data:2,model:2`: one mesh for the splits; wrong meshes are one
line before anything is built; a mesh run's checkpoint evaluates the same
on one device."""

import os
import re

import numpy as np
import pytest

from framework.errors import ConfigError
from framework.model_parallel import ModelParallelConfig
from framework.model_parallel.config import check_device_count, parse_mesh
from tests import helpers

GPT = ["--model=gpt", "--dataset=text", "--global_batch_size=8",
       "--sequence_length=16", "--model_width=32", "--num_heads=4",
       "--num_layers=2"]


def test_a_mesh_sets_the_split_and_its_data_axis():
  tensor = ModelParallelConfig(mesh="data:2,model:2")
  assert (tensor.mode, tensor.num_shards, tensor.data_axis) == ("tensor", 2,
                                                                2)
  pipeline = ModelParallelConfig(mesh="pipeline:3")
  assert (pipeline.mode, pipeline.num_stages, pipeline.data_axis) == (
      "pipeline", 3, 1)
  # The shorthand and the mesh agree, or it is an error.
  assert ModelParallelConfig(mode="tensor", mesh="model:4").num_shards == 4
  with pytest.raises(ConfigError, match="disagrees with --model_parallel"):
    ModelParallelConfig(mode="pipeline", mesh="data:2,model:2")


def test_a_mesh_with_model_and_pipeline_axes_is_a_staged_tensor_split():
  both = ModelParallelConfig(mesh="model:2,pipeline:2")
  assert (both.mode, both.num_shards, both.tensor_stages, both.data_axis,
          both.device_count) == ("tensor", 2, 2, 1, (4, "num_shards"))
  three = ModelParallelConfig(mesh="data:2,model:2,pipeline:2")
  assert (three.num_shards, three.tensor_stages, three.data_axis) == (2, 2, 2)
  assert three.trainer_factory().keywords["tensor_stages"] == 2
  # Without a pipeline axis the tensor split has one stage, as before.
  assert "tensor_stages" not in ModelParallelConfig(
      mesh="data:2,model:2").trainer_factory().keywords


@pytest.mark.parametrize("model, layers, message", [
    ("mlp", 2, "mesh=model:2,pipeline:2: tensor x pipeline (model and "
     "pipeline axes both > 1) splits a transformer; model=mlp"),
    ("gpt", 1, "mesh=model:2,pipeline:2: the pipeline axis=2 needs at least "
     "one gpt block per stage; num_layers=1"),
])
def test_a_tensor_by_pipeline_mesh_the_model_cannot_take_is_one_line(
    model, layers, message):
  config = ModelParallelConfig(mesh="model:2,pipeline:2")
  with pytest.raises(ConfigError, match=re.escape(message)) as error:
    config.check_model(model, num_heads=4, vocab_size=64, num_layers=layers)
  assert "\n" not in str(error.value)


@pytest.mark.parametrize("mesh, message", [
    ("data:2,shards:2", "unknown axis 'shards'; the axes are data, model, "
     "pipeline"),
    ("data:2,model:0", "the size of 'model' must be a positive integer"),
    ("data:x,model:2", "the size of 'data' must be a positive integer"),
    ("model:2,model:2", "names the axis 'model' twice"),
    ("data2", "must be axis:size"),
    ("data:4", "splits no model"),
])
def test_a_bad_mesh_is_one_line(mesh, message):
  with pytest.raises(ConfigError, match=re.escape(message)) as error:
    parse_mesh(mesh)
  assert "\n" not in str(error.value)


def test_the_axes_must_multiply_to_the_devices():
  check_device_count("data:2,model:2", {"data": 2, "model": 2}, 0, 4)
  check_device_count("data:2,model:2", {"data": 2, "model": 2}, 4, 1)
  for gpus, cpus in ((0, 2), (0, 8), (2, 8)):
    with pytest.raises(ConfigError, match="has 4 devices"):
      check_device_count("data:2,model:2", {"data": 2, "model": 2}, gpus,
                         cpus)


@pytest.mark.slow
@pytest.mark.parametrize("flags, fragments", [
    (["--mesh=data:2,model:2", "--cpu_devices=2"],
     ["has 4 devices", "this process has 2"]),
    (["--mesh=data:2,model:3", "--cpu_devices=6"],
     ["the model axis=3 does not divide gpt num_heads=4"]),
    (["--mesh=data:2,rows:2", "--cpu_devices=4"], ["unknown axis 'rows'"]),
    (["--mesh=data:2,model:2,pipeline:2", "--cpu_devices=4"],
     ["has 8 devices", "this process has 4"]),
    (["--mesh=model:2,pipeline:4", "--cpu_devices=8"],
     ["the pipeline axis=4 needs at least one gpt block per stage"]),
])
def test_train_py_on_a_wrong_mesh_is_one_line_and_writes_nothing(
    tmp_path, flags, fragments):
  model_dir = tmp_path / "run"
  model_dir.mkdir()
  before = helpers.snapshot(str(model_dir))
  proc = helpers.run_script("train.py", *GPT, f"--model_dir={model_dir}",
                            "--train_steps=2", *flags, check=False)
  helpers.assert_one_line_error(proc, "train.py", *fragments,
                                unchanged=before)


def _train_eval_loss(proc):
  found = re.findall(r"final eval: \{'loss': ([0-9.]+)", proc.stderr)
  assert found, proc.stderr[-3000:]
  return float(found[-1])


def _evaluate_loss(proc):
  found = re.findall(r"^\s*loss\s+([0-9.]+)\s*$",
                     proc.stdout + "\n" + proc.stderr, re.M)
  assert found, (proc.stdout + proc.stderr)[-3000:]
  return float(found[-1])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  """train/ and test/ text of a few kilobytes: both evaluations read the
  whole test split (the built-in corpus has tens of thousands of test
  windows)."""
  root = tmp_path_factory.mktemp("corpus")
  rng = np.random.default_rng(7)
  words = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta"]
  for split, size in (("train", 600), ("test", 120)):
    os.makedirs(root / split)
    (root / split / f"{split}.txt").write_text(
        " ".join(rng.choice(words, size=size)) + "\n")
  return str(root)


@pytest.mark.slow
@pytest.mark.parametrize("mesh, devices, piece", [
    ("data:2,model:2", 4, "2-way"),
    ("data:2,model:2,pipeline:2", 8, "4-way"),  # 2 stages of 2 shards
])
def test_a_mesh_checkpoint_evaluates_the_same_on_one_device(
    tmp_path, corpus, mesh, devices, piece):
  model_dir = str(tmp_path / "mesh")
  # One GPT block where no pipeline axis needs two (one per stage): each
  # process traces its model in a third less time.
  layers = 2 if "pipeline" in mesh else 1
  train = helpers.run_script("train.py", *GPT, f"--num_layers={layers}",
                             f"--model_dir={model_dir}",
                             f"--data_dir={corpus}",
                             "--train_steps=4", "--steps_per_loop=2",
                             f"--mesh={mesh}", f"--cpu_devices={devices}",
                             # evaluate.py reads the checkpoint.
                             "--export_saved_model=false", timeout=900)
  assert f"data x tensor: 2 copies of a {piece} tensor split" in train.stderr
  assert os.path.exists(os.path.join(model_dir, "ckpt-4.index"))
  # From another folder, no mesh, one device: the unsplit GPT restores the
  # split checkpoint.
  evaluate = helpers.run_script("evaluate.py", f"--model_dir={model_dir}",
                                cwd=str(tmp_path), timeout=900)
  assert abs(_evaluate_loss(evaluate) - _train_eval_loss(train)) < 1e-5
