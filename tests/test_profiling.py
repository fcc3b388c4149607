"""--profile_steps: an exact window of steps traced into TensorBoard."""

import os

import pytest

from framework.perf import profiling
from framework.errors import ConfigError
from test_train_script import events, train

# The MLP with one hidden layer: 2 matmuls forward, 3 backward (no input
# gradient for the first layer), whichever kernels oneDNN picks.
MATMULS_PER_STEP = 5


def matmul_count(table):
  return sum(count for name, _, count in table.rows if "MatMul" in name)


def profile_text(model_dir):
  acc = events(os.path.join(model_dir, "train"))
  return {e.step: e.tensor_proto.string_val[0].decode()
          for e in acc.Tensors("profile/op_time")}


@pytest.mark.parametrize("value", [(0, 3), (5, 3), (3,), (1, 2, 3),
                                   ("a", 2), (True, 2)])
def test_bad_profile_steps_name_the_argument(value):
  with pytest.raises(ConfigError, match=r"profile_steps=.*first <= last"):
    profiling.check_profile_steps(value)


def test_profile_steps_trace_exactly_the_window(tmp_path):
  proc = train(tmp_path, "--train_steps=8", "--steps_per_loop=4",
               "--profile_steps=3,5")
  assert "profile of steps 3..5" in proc.stderr
  trace = profiling.latest_trace(os.path.join(tmp_path, "train"))
  assert trace and trace.endswith(".xplane.pb")
  table = profiling.op_table(trace)
  assert matmul_count(table) == 3 * MATMULS_PER_STEP  # steps 3, 4 and 5
  assert 0 < table.wall_ms and 0 < table.total_ms
  text = profile_text(tmp_path)
  assert list(text) == [5]
  assert "| op type | ms | share | count |" in text[5]
  assert "MatMul" in text[5]


def test_a_window_past_the_last_step_ends_with_the_run(tmp_path):
  train(tmp_path, "--train_steps=8", "--steps_per_loop=4",
        "--profile_steps=7,100")
  table = profiling.op_table(
      profiling.latest_trace(os.path.join(tmp_path, "train")))
  assert matmul_count(table) == 2 * MATMULS_PER_STEP  # steps 7 and 8
  assert list(profile_text(tmp_path)) == [8]
