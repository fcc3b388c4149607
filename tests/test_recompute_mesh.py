"""Recomputation on a `data:2,model:2` mesh (two copies of a 2-way tensor
split of the GPT, 4 logical CPU devices): the weights of the run without it.

`--recompute=every:K` recomputes an unsplit model's top-level layers; on a
mesh it is one line (`test_recompute.py`'s bad-value test)."""

import pytest

from tests import helpers
from tests.test_recompute import _assert_close, _weights

# A size and seed of this file's own; 4 devices need a process of their own
# (train.py's --cpu_devices, set before TensorFlow starts).
GPT = ["--model=gpt", "--dataset=text", "--global_batch_size=8",
       "--sequence_length=10", "--model_width=16", "--num_heads=2",
       "--num_layers=2", "--seed=8642", "--train_steps=3",
       "--optimizer=momentum", "--learning_rate=0.05",
       "--mesh=data:2,model:2", "--cpu_devices=4",
       # Two evaluation batches, no SavedModel: as test_recompute.py's.
       "--eval_steps=2", "--export_saved_model=false"]


@pytest.mark.slow
def test_gpt_on_a_data_by_model_mesh_recomputed_equals_not_recomputed(
    tmp_path):
  def train(value):
    helpers.run_script("train.py", f"--model_dir={tmp_path / value}", *GPT,
                       f"--recompute={value}")
    return _weights(tmp_path / value)

  reference = train("none")
  # true: the split's one stage (the whole split model) per micro-batch.
  for value in ("blocks", "attention", "true"):
    _assert_close(train(value), reference)
