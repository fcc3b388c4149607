"""`--spike_policy` with a model split is one line: a split's step (and
the sharded update of its copies, ZeRO on a mesh's data axis) applies its
update without the spike check, so it would train through the spikes."""

import re

import pytest

from framework.app.config import ExperimentConfig
from framework.errors import ConfigError
from framework.model_parallel import ModelParallelConfig
from tests import helpers


@pytest.mark.parametrize("mesh,model,sharded", [
    ("data:2,model:2", "gpt", True),
    ("data:2,pipeline:2", "mlp", True),
    ("data:2,pipeline:2", "mlp", False),
])
def test_the_config_refuses_it(mesh, model, sharded):
  zero = (dict(shard_optimizer_state=True, shard_gradients=True,
               shard_parameters=True) if sharded else {})
  with pytest.raises(ConfigError, match=re.escape(
      f"spike_policy=skip is not supported with mesh={mesh}")) as error:
    ExperimentConfig(model_dir="run", train_steps=1, model=model,
                     dataset="synthetic", spike_policy="skip",
                     model_parallel=ModelParallelConfig(mesh=mesh), **zero)
  assert "\n" not in str(error.value)


def test_the_trainer_refuses_it():
  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from framework import model_parallel as mp  # pylint: disable=g-import-not-at-top
  from tests import model_parallel_reference as ref  # pylint: disable=g-import-not-at-top
  model = ref.build("mlp", (7,), 5, seed=6312, hidden_units=(8,))
  with pytest.raises(ConfigError, match="spike_policy=rollback"):
    mp.PipelineTrainer(model, keras.optimizers.Adam(1e-2),
                       tf.distribute.get_strategy(), num_stages=2,
                       devices=["/CPU:0", "/CPU:1"], global_batch_size=8,
                       spike_policy="rollback")


def test_train_py_on_a_zero3_gpt_mesh_is_one_line(tmp_path):
  run = tmp_path / "run"
  run.mkdir()
  before = helpers.snapshot(run)
  proc = helpers.run_script(
      "train.py", "--model=gpt", "--dataset=text", "--cpu_devices=4",
      "--mesh=data:2,model:2", "--shard_optimizer_state", "--shard_gradients",
      "--shard_parameters", "--spike_policy=skip", "--sequence_length=16",
      "--model_width=16", "--num_heads=2", "--num_layers=1",
      "--global_batch_size=8", "--train_steps=4", f"--model_dir={run}",
      check=False)
  helpers.assert_one_line_error(proc, "train.py", "spike_policy=skip",
                                "mesh=data:2,model:2", unchanged=before)
