"""`checkpoint_sharding=by_task`: a weight cut over devices is written as
one slice per shard from its own device (under the whole tensor's key), so
a checkpoint of either sharding restores into a split weight and into an
unsplit variable; by_task where it means nothing is one line before anything is
written. The 2-process runs (what each task writes, resuming across
processes) are in tests/test_checkpoint_portability.py."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from framework import _tf_internal
from framework.app.config import ExperimentConfig
from framework.core.checkpoints import sharding
from framework.core.config import LoopConfig
from framework.errors import ConfigError
from framework.model_parallel.parallel_layers import ShardedWeight
from tests import helpers

WHOLE = np.arange(6 * 4, dtype=np.float32).reshape(6, 4) / 7


def _cut(value, axis=0):
  """A ShardedWeight over 2 Keras variables (as a split layer's) on the
  tests' 2 CPU devices."""
  shards = []
  for d, piece in enumerate(np.split(value, 2, axis=axis)):
    with tf.device(f"/CPU:{d}"):
      shards.append(keras.Variable(piece))
  return ShardedWeight(shards, axis)


def _save(obj, prefix, how):
  with sharding.active(how):
    return tf.train.Checkpoint(w=obj).write(
        prefix, options=sharding.options(how))


def _restore(obj, path):
  tf.train.Checkpoint(w=obj).read(path).assert_existing_objects_matched()


@pytest.mark.parametrize("axis", [0, 1])
def test_by_task_writes_one_slice_per_shard_under_the_whole_key(tmp_path,
                                                                 axis):
  path = _save(_cut(WHOLE, axis), str(tmp_path / "ckpt"), "by_task")
  reader = tf.train.load_checkpoint(path)
  key, = [k for k in reader.get_variable_to_shape_map()
          if k.startswith("w/")]
  # The whole tensor's key and shape, read whole out of the slices.
  assert reader.get_variable_to_shape_map()[key] == [6, 4]
  np.testing.assert_array_equal(reader.get_tensor(key), WHOLE)
  # Slices: the saver wrote the shards as they were, not joined.
  assert len(_serialized(_cut(WHOLE, axis), "by_task")) == 2
  assert len(_serialized(_cut(WHOLE, axis), "gathered")) == 1


def _serialized(weight, how):
  with sharding.active(how):
    # pylint: disable-next=protected-access
    value = weight._serialize_to_tensors()[_tf_internal.VARIABLE_VALUE_KEY]
  return value if isinstance(value, dict) else {"": value}


@pytest.mark.parametrize("saved,restored", [
    ("by_task", "split"), ("gathered", "split"), ("by_task", "whole"),
    ("whole", "split")])
def test_either_sharding_restores_into_a_split_and_a_whole_variable(
    tmp_path, saved, restored):
  source = tf.Variable(WHOLE) if saved == "whole" else _cut(WHOLE)
  path = _save(source, str(tmp_path / "ckpt"),
               "gathered" if saved == "whole" else saved)
  if restored == "whole":
    target = tf.Variable(tf.zeros_like(WHOLE))
    _restore(target, path)
    np.testing.assert_array_equal(target.numpy(), WHOLE)
    return
  target = _cut(np.zeros_like(WHOLE))
  _restore(target, path)
  np.testing.assert_array_equal(target.numpy(), WHOLE)
  # Each shard got its own rows, on its own device.
  for d, shard in enumerate(target.shards):
    assert shard.value.device.endswith(f"CPU:{d}")
    np.testing.assert_array_equal(shard.numpy(), WHOLE[3 * d:3 * d + 3])


def test_options_name_the_policy_and_refuse_an_unknown_sharding():
  policy = sharding.options("by_task").experimental_sharding_callback
  assert isinstance(policy, tf.train.experimental.ShardByTaskPolicy)
  assert sharding.options("gathered").experimental_sharding_callback is None
  with pytest.raises(ConfigError, match="checkpoint_sharding.*by_task"):
    sharding.options("by_device")


@pytest.mark.parametrize("flags,fragment", [
    ([], "strategy=default without a model split over the cluster"),
    (["--strategy=mirrored"], "strategy=mirrored without a model split"),
    (["--model=gpt", "--dataset=text", "--mesh=data:2,model:2",
      "--cpu_devices=4"], "strategy=default without a model split"),
])
def test_by_task_where_it_means_nothing_is_one_line_before_anything(
    tmp_path, flags, fragment):
  model_dir = str(tmp_path / "run")
  os.makedirs(model_dir)
  before = helpers.snapshot(model_dir)
  proc = helpers.run_script(
      "train.py", "--model=mlp", "--dataset=synthetic", "--train_steps=2",
      *flags, "--checkpoint_sharding=by_task", f"--model_dir={model_dir}",
      check=False)
  helpers.assert_one_line_error(
      proc, "train.py", "checkpoint_sharding=by_task", fragment,
      "use checkpoint_sharding=gathered", unchanged=before)


@pytest.mark.parametrize("strategy,fragment", [
    ("parameter_server", "keeps the variables on the ps tasks"),
    ("multi_worker_mirrored", "each process hold (and write) a whole copy")])
def test_the_config_refuses_by_task_without_a_cluster_split(
    tmp_path, strategy, fragment):
  loop = LoopConfig(train_steps=1, checkpoint_sharding="by_task")
  with pytest.raises(ConfigError, match="model_parallel_devices=cluster") as e:
    ExperimentConfig(model_dir=str(tmp_path), train_steps=1, loop=loop,
                     strategy=strategy)
  assert fragment in str(e.value)
  # gathered, or by_task on a split over the cluster's workers, is a run.
  ExperimentConfig(model_dir=str(tmp_path), train_steps=1,
                   loop=LoopConfig(train_steps=1), strategy=strategy)
