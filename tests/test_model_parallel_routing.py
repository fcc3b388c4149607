"""A pipeline split of a model with its own whole-model split (the gpt) runs
that split with one shard per stage; every other model keeps the layer
cut. A transformer split checkpoints its optimizer as an unsplit run does,
so a checkpoint of any split restores into any other, slots included
(in-process, 2 logical devices; train.py across meshes:
test_model_parallel_mesh_resume.py)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import framework
from framework import model_parallel as mp
from framework.core import checkpoints
from framework.errors import ConfigError
from framework.model_parallel.pipeline import PipelineTrainer
from framework.model_parallel.tensor_parallel import TensorParallelTrainer
from tests.model_parallel_reference import STRATEGY, build
from tests.transformer_split_reference import (BATCH, relative, tiny_gpt,
                                               token_batches)

TOLERANCE = 1e-5
STEPS = 2  # before the checkpoint; as many after it


def _mlp():
  return build("mlp", (8,), 4, hidden_units=(16, 16))


@pytest.mark.parametrize("flags", [dict(mesh="pipeline:2"),
                                   dict(mode="pipeline", num_stages=2)])
def test_a_gpt_pipeline_runs_its_own_split_and_an_mlp_its_layers_cut(flags):
  factory = mp.ModelParallelConfig(**flags).trainer_factory()
  gpt = factory(tiny_gpt(), keras.optimizers.SGD(0.1), STRATEGY,
                global_batch_size=BATCH)
  assert isinstance(gpt, TensorParallelTrainer)
  # One shard per stage: blocks 0 and 1 on their own device each.
  assert [list(b.devices) for b in gpt.model.blocks] == [["/CPU:0"],
                                                         ["/CPU:1"]]
  mlp = factory(_mlp(), keras.optimizers.SGD(0.1), STRATEGY,
                global_batch_size=BATCH)
  assert type(mlp) is PipelineTrainer  # pylint: disable=unidiomatic-typecheck


def test_stage_boundaries_for_a_gpt_pipeline_are_one_line():
  factory = mp.ModelParallelConfig(
      mode="pipeline", num_stages=2, stage_boundaries=(3,)).trainer_factory()
  with pytest.raises(ConfigError, match=r"stage_boundaries=\[3\] cut a list "
                     "of layers; model=gpt is cut") as error:
    factory(tiny_gpt(), keras.optimizers.SGD(0.1), STRATEGY,
            global_batch_size=BATCH)
  assert "\n" not in str(error.value)


def test_a_gpt_pipeline_needs_a_block_per_stage_before_any_build():
  with pytest.raises(ConfigError, match="mesh=pipeline:4: the pipeline "
                     "axis=4 needs at least one gpt block per stage; "
                     "num_layers=2"):
    mp.ModelParallelConfig(mesh="pipeline:4").check_model("gpt", 4, 64, 2)


def _trainer(kind):
  """A trainer of the tiny gpt with Adam: unsplit, tensor 2-way, or the
  2-stage pipeline (one shard per stage)."""
  model, optimizer = tiny_gpt(), keras.optimizers.Adam(1e-2)
  if kind == "unsplit":
    return framework.Trainer(model, optimizer, STRATEGY,
                             global_batch_size=BATCH)
  return TensorParallelTrainer(
      model, optimizer, STRATEGY, global_batch_size=BATCH,
      devices=["/CPU:0", "/CPU:1"],
      **(dict(num_shards=2) if kind == "tensor" else
         dict(num_shards=1, tensor_stages=2)))


def _data(skip):
  x, y = token_batches(2 * STEPS)
  return iter(tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
              .skip(skip))


def _state(trainer, directory):
  """(checkpoint keys, weights, Adam slots) of `trainer`'s checkpoint."""
  path = tf.train.Checkpoint(**checkpoints.checkpoint_objects(trainer)).write(
      str(directory / "state"))
  reader = tf.train.load_checkpoint(path)
  keys = sorted(k for k in reader.get_variable_to_shape_map()
                if k.startswith("optimizer/"))
  weights = [reader.get_tensor(k) for k in keys
             if "_trainable_variables" in k]
  slots = [reader.get_tensor(k) for k in keys if "/_variables/" in k]
  return keys, weights, slots


@pytest.fixture(scope="module")
def continuous(tmp_path_factory):
  trainer = _trainer("unsplit")
  trainer.train(_data(0), 2 * STEPS)
  return _state(trainer, tmp_path_factory.mktemp("continuous"))


def _flat(arrays):
  return np.concatenate([np.ravel(a) for a in arrays])


@pytest.mark.slow
@pytest.mark.parametrize("first, second", [("tensor", "unsplit"),
                                           ("unsplit", "tensor")])
def test_a_split_checkpoint_resumes_on_another_split_slots_included(
    tmp_path, continuous, first, second):
  before = _trainer(first)
  before.train(_data(0), STEPS)
  path = tf.train.Checkpoint(**checkpoints.checkpoint_objects(before)).save(
      str(tmp_path / "ckpt"))
  after = _trainer(second)
  status = tf.train.Checkpoint(
      **checkpoints.checkpoint_objects(after)).restore(path)
  # Every value of the checkpoint has its place, and every one is used: no
  # slot is silently left at its start.
  status.assert_existing_objects_matched()
  status.assert_consumed()
  after.train(_data(STEPS), STEPS)
  keys, weights, slots = _state(after, tmp_path)
  want_keys, want_weights, want_slots = continuous
  assert keys == want_keys  # the same keys whatever the split
  differences = (relative(_flat(weights), _flat(want_weights)),
                 relative(_flat(slots), _flat(want_slots)))
  print("max relative differences (weights, slots):", differences)
  assert max(differences) < TOLERANCE, differences
  assert int(after.optimizer.iterations.numpy()) == 2 * STEPS
