"""Bad input is one line, exit status 1, and leaves --model_dir as it was.

Each case runs the real script in a fresh process (issue 15, item 8): the
error must come before the run writes anything, as `<script>: error: ...`
with no traceback, and the model directory (here holding a user's file) must
be byte-for-byte unchanged.
"""

import json
import os
import sys

import numpy as np
import pytest

import framework
import framework.data.datasets  # noqa: F401  (the attribute chain below)
from framework.distribute import launcher, tf_config
from framework.errors import ConfigError
from tests.helpers import (ROOT, assert_one_line_error, free_port, run_script,
                           snapshot)

TINY = ["--model=mlp", "--dataset=synthetic", "--hidden_units=8",
        "--global_batch_size=32", "--train_steps=2", "--steps_per_loop=2",
        "--export_saved_model=false"]
TRAIN = os.path.join(ROOT, "scripts", "train.py")


@pytest.fixture
def model_dir(tmp_path):
  """A model_dir that already holds a user's file (which must survive)."""
  path = tmp_path / "run"
  path.mkdir()
  (path / "notes.txt").write_text("my notes")
  return path


def train_fails(model_dir, *args, fragments=(), env=None):
  """Runs train.py expecting one error line; returns that line."""
  before = snapshot(model_dir)
  proc = run_script("train.py", f"--model_dir={model_dir}", *args,
                    check=False, env=dict({"TF_CONFIG": None}, **(env or {})))
  return assert_one_line_error(proc, "train.py", *fragments,
                               unchanged=before)


@pytest.mark.parametrize("units", ["0", "16,-4"])
def test_hidden_units_not_positive(model_dir, units):
  train_fails(model_dir, *TINY, f"--hidden_units={units}",
              fragments=["hidden_units", "integer >= 1"])


@pytest.mark.parametrize("split,label", [("train", 10), ("test", -1)])
def test_labels_out_of_range_fail_before_writing(model_dir, tmp_path, split,
                                                 label):
  data = framework.data.datasets.synthetic(num_train=64, num_test=16, seed=1)
  train_y, test_y = data.train_y.copy(), data.test_y.copy()
  (train_y if split == "train" else test_y)[5] = label
  data_dir = str(tmp_path / "cifar-10-batches-py")
  framework.data.datasets.write_cifar10(data_dir, data.train_x, train_y, data.test_x,
                          test_y)
  line = train_fails(model_dir, *TINY, "--dataset=cifar10",
                     f"--data_dir={data_dir}",
                     fragments=[f"{split} example 5", f"label {label}",
                                "0..9"])
  assert data_dir in line


@pytest.mark.parametrize("args,fragments", [
    (["--model=unet", "--unet_depth=1", "--unet_width=4"],
     ["model='unet' is a segmentation model", "dataset='synthetic'",
      "cifar_cnn, mlp"]),
    (["--model=cifar_cnn", "--dataset=shapes", "--image_size=16"],
     ["model='cifar_cnn' is a classification model", "dataset='shapes'",
      "unet"]),
])
def test_model_of_the_wrong_task(model_dir, args, fragments):
  train_fails(model_dir, *TINY, *args, fragments=fragments)


def test_global_file_shuffle_of_an_in_memory_dataset(model_dir):
  train_fails(model_dir, *TINY, "--file_shuffle=global",
              fragments=["file_shuffle=global", "streamed from files",
                         "dataset=synthetic"])


def test_model_of_the_wrong_task_before_the_distribution_check(model_dir):
  train_fails(model_dir, *TINY, "--model=unet", "--unet_depth=1",
              "--unet_width=4", "--check_distribution",
              fragments=["is a segmentation model"])


def test_profile_steps_past_the_last_step(model_dir):
  train_fails(model_dir, *TINY, "--profile_steps=5,6",
              fragments=["profile_steps=(5, 6)", "train_steps=2", "1..2"])


def test_cifar10_without_data_dir_offline(model_dir, tmp_path):
  # No Keras cache (a fresh HOME) and no network (a proxy nobody serves).
  proxy = f"http://127.0.0.1:{free_port()}"
  home = tmp_path / "home"
  home.mkdir()
  train_fails(model_dir, *TINY, "--dataset=cifar10",
              fragments=["--data_dir", "cifar-10-batches-py",
                         "downloading it failed"],
              env={"HOME": str(home), "KERAS_HOME": None,
                   "http_proxy": proxy, "https_proxy": proxy,
                   "HTTP_PROXY": proxy, "HTTPS_PROXY": proxy,
                   "no_proxy": None, "NO_PROXY": None})


def test_duplicate_worker_addresses_fail_at_once(model_dir):
  address = f"127.0.0.1:{free_port()}"
  config = {"cluster": {"worker": [address, address]},
            "task": {"type": "worker", "index": 0}}
  # Without the check the run waits out --startup_timeout for a peer that
  # cannot listen; the error line then names the missing task instead.
  train_fails(model_dir, *TINY, "--strategy=multi_worker_mirrored",
              "--startup_timeout=20",
              fragments=["cluster.worker[1]", "cluster.worker[0]",
                         repr(address), "its own host:port"],
              env={"TF_CONFIG": json.dumps(config)})


def test_duplicate_addresses_across_roles():
  with pytest.raises(ConfigError, match=r"cluster.ps\[0\] and "
                     r"cluster.chief\[0\] are both '127.0.0.1:5000'"):
    tf_config.parse_tf_config(json.dumps(
        {"cluster": {"chief": ["127.0.0.1:5000"],
                     "ps": ["127.0.0.1:5000"],
                     "worker": ["127.0.0.1:5001"]},
         "task": {"type": "chief", "index": 0}}))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """A finished tiny run and a PNG to classify."""
  from PIL import Image  # pylint: disable=g-import-not-at-top
  root = tmp_path_factory.mktemp("trained")
  run_script("train.py", *TINY, f"--model_dir={root / 'run'}")
  png = root / "image.png"
  Image.fromarray(np.full((32, 32, 3), 128, np.uint8)).save(png)
  return root


@pytest.mark.parametrize("flag,fragments", [
    ("--output_json={root}/missing/out.json",
     ["--output_json", "missing", "does not exist"]),
    ("--save_image={root}/out.xyz", ["--save_image", "'.xyz'", ".png"]),
])
def test_predict_outputs_are_checked_first(trained, flag, fragments):
  before = snapshot(trained)
  proc = run_script("predict.py", f"--model_dir={trained / 'run'}",
                    f"--image={trained / 'image.png'}",
                    flag.format(root=trained), check=False)
  assert_one_line_error(proc, "predict.py", *fragments, unchanged=before)
  assert "predicted:" not in proc.stdout  # checked before the work


def test_evaluate_watch_without_checkpoints_fails(model_dir):
  # A run started (model_info.json) but no checkpoint ever came.
  info = {"model": "mlp", "model_options": {"hidden_units": [8]},
          "input_shape": [32, 32, 3], "num_classes": 10,
          "class_names": [f"class_{i}" for i in range(10)],
          "dataset": "synthetic", "data_dir": None, "dataset_options": {},
          "global_batch_size": 32, "strategy": "default", "seed": 0,
          "train_steps": 2}
  (model_dir / "model_info.json").write_text(json.dumps(info))
  before = snapshot(model_dir)
  proc = run_script("evaluate.py", f"--model_dir={model_dir}", "--watch",
                    "--poll_seconds=0.2", "--timeout_seconds=1",
                    check=False)
  assert_one_line_error(proc, "evaluate.py", "no checkpoint appeared",
                        "nothing was evaluated", unchanged=before)


def launch_fails(*command, fragments=(), unchanged=None):
  proc = run_script("launch.py", "--workers=2", "--grace_period=1", "--",
                    *command, check=False, timeout=300)
  return assert_one_line_error(proc, "launch.py", *fragments,
                               unchanged=unchanged)


def test_launch_a_missing_program():
  launch_fails("/nonexistent/binary", "--flag",
               fragments=["'/nonexistent/binary'", "not an executable"])


@pytest.mark.parametrize("strategy", [["--strategy=mirrored"], []])
def test_launch_without_a_cluster_strategy(model_dir, strategy):
  # Each task would train on its own, all into one model_dir.
  launch_fails(sys.executable, TRAIN, *TINY, f"--model_dir={model_dir}",
               *strategy, fragments=["2 independent runs",
                                     "--strategy=multi_worker_mirrored"],
               unchanged=snapshot(model_dir))


def test_launch_strategy_from_a_flag_file(tmp_path):
  flagfile = tmp_path / "run.cfg"
  flagfile.write_text("--model=mlp\n--strategy=one_device\n")
  cluster = {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}
  command = [sys.executable, TRAIN, f"--flagfile={flagfile}"]
  with pytest.raises(ConfigError, match="strategy=one_device"):
    launcher.check_command(command, cluster)
  # A later flag wins, as in absl; then the job can start.
  launcher.check_command(command + ["--strategy=multi_worker_mirrored"],
                         cluster)
  with pytest.raises(ConfigError, match="has ps tasks: use "
                     "--strategy=parameter_server"):
    launcher.check_command(command + ["--strategy=multi_worker_mirrored"],
                           dict(cluster, ps=["127.0.0.1:3"]))


@pytest.mark.parametrize("returncode,stderr,change", [
    (1, "train.py: error: bad\n" * 4, False),  # four lines
    (2, "train.py: error: bad\n", False),  # wrong status
    (1, "Traceback (most recent call last):\ntrain.py: error: bad\n", False),
    (1, "evaluate.py: error: bad\n", False),  # another script's line
    (1, "train.py: error: bad\nValueError: boom\n", False),
    (1, "train.py: error: bad\n", True),  # the directory changed
])
def test_the_helper_itself_can_fail(tmp_path, returncode, stderr, change):
  import subprocess  # pylint: disable=g-import-not-at-top
  noise = "E0000 00:00:1.0 1 cuda_platform.cc:52] CUDA error: no GPU\n"
  ok = subprocess.CompletedProcess([], 1, "", noise + "train.py: error: bad\n")
  before = snapshot(tmp_path)
  assert assert_one_line_error(ok, "train.py", "bad", unchanged=before)
  if change:
    (tmp_path / "new").write_text("")
  bad = subprocess.CompletedProcess([], returncode, "", noise + stderr)
  with pytest.raises(AssertionError):
    assert_one_line_error(bad, "train.py", "bad", unchanged=before)
