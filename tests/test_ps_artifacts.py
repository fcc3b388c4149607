"""A parameter-server run leaves what every run leaves, and the tools use it.

The coordinator drives the same Controller as every other strategy
(framework/core/ps_training.py), so its model_dir holds the same artifacts as a
single-process run, and evaluate.py / predict.py work on it.
"""

import glob
import json
import os
import re
import signal

import numpy as np
import pytest
import tensorflow as tf

import framework
import framework.data.datasets  # noqa: F401  (the attribute chain below)
from framework.app import experiment, export
from framework.distribute import launcher
from tests import cluster_utils as cu
from tests.helpers import run_script

FLAGS = cu.MLP + ["--steps_per_loop=10", "--log_every=10",
                  "--summary_every=10", "--train_steps=40",
                  "--checkpoint_every=20", "--eval_every=20",
                  # Options the old parameter-server loop dropped.
                  "--grad_accum_steps=2", "--augment=crop_flip"]


def _artifacts(model_dir):
  """The names in `model_dir`, checkpoint steps and data shards as `*`."""
  names = set()
  for name in os.listdir(model_dir):
    name = re.sub(r"^ckpt-\d+\.data-\d+-of-\d+$", "ckpt-*.data-*", name)
    # The HParams session's event file (its name has a time and a pid).
    name = re.sub(r"^events\.out\.tfevents\..*$", "events.out.tfevents.*",
                  name)
    names.add(re.sub(r"^ckpt-\d+\.index$", "ckpt-*.index", name))
  return names


def _events(logdir):
  """{tag: [(step, value or None)]} of the event files under `logdir`."""
  tags = {}
  for path in glob.glob(os.path.join(logdir, "events.*")):
    for event in tf.compat.v1.train.summary_iterator(path):
      for value in event.summary.value:
        array = tf.make_ndarray(value.tensor)
        number = float(array) if array.dtype.kind == "f" else None
        tags.setdefault(value.tag, []).append((event.step, number))
  return tags


def _printed(text, name):
  """The value of `  name  value` in evaluate.py's output."""
  return float(re.search(rf"^\s+{name}\s+(\S+)$", text, re.M).group(1))


@pytest.mark.slow
def test_parameter_server_run_has_every_artifact_for_evaluate_and_predict(
    tmp_path):
  ps_dir, single_dir = str(tmp_path / "ps"), str(tmp_path / "single")
  proc = cu.launch(FLAGS + ["--strategy=parameter_server",
                            f"--model_dir={ps_dir}"], workers=2, ps=1,
                   timeout=400)
  assert proc.returncode == 0, proc.stdout[-4000:]
  assert "train step 40/40" in proc.stdout
  run_script("train.py", *FLAGS, "--strategy=default",
             f"--model_dir={single_dir}")

  # The same files, written by the same Controller.
  assert _artifacts(ps_dir) == _artifacts(single_dir)
  assert {"model_info.json", export.WEIGHTS_FILE, export.EXPORT_DIR,
          "checkpoint", "ckpt-*.index", "ckpt-*.data-*", "train",
          "eval"} <= _artifacts(ps_dir)
  assert cu.checkpoint_step(ps_dir) == 40 and cu.global_step(ps_dir) == 40
  info = export.read_model_info(ps_dir)
  assert info["strategy"] == "parameter_server"
  assert info["train_steps"] == 40 and info["model"] == "mlp"
  # The same TensorBoard tags at the same steps.
  ps_train, ps_eval = (_events(os.path.join(ps_dir, d))
                       for d in ("train", "eval"))
  single_train, single_eval = (_events(os.path.join(single_dir, d))
                               for d in ("train", "eval"))
  assert ps_train.keys() == single_train.keys() and "loss" in ps_train
  assert ps_eval.keys() == single_eval.keys() and "accuracy" in ps_eval
  assert [s for s, _ in ps_train["loss"]] == [10, 20, 30, 40]
  assert [s for s, _ in ps_eval["accuracy"]] == [20, 40]
  final_accuracy = ps_eval["accuracy"][-1][1]

  # evaluate.py in a fresh process: the coordinator's final evaluation.
  proc = run_script("evaluate.py", f"--model_dir={ps_dir}")
  assert f"{ps_dir}/ckpt-40 (step 40): 512 examples" in proc.stdout
  assert _printed(proc.stdout, "accuracy") == pytest.approx(final_accuracy,
                                                            abs=1e-6)
  assert np.isfinite(_printed(proc.stdout, "loss"))

  # predict.py in a fresh process (model_info.json + model.weights.h5)
  # agrees with the SavedModel export on a test image.
  image = framework.data.datasets.load_dataset("synthetic", seed=0).test_x[7]
  png, out_json = str(tmp_path / "7.png"), str(tmp_path / "7.json")
  from PIL import Image  # pylint: disable=g-import-not-at-top
  Image.fromarray(image).save(png)
  proc = run_script("predict.py", f"--model_dir={ps_dir}", f"--image={png}",
                    f"--output_json={out_json}")
  summary = json.load(open(out_json))
  assert f"predicted: {summary['predicted_class']}" in proc.stdout
  probabilities = np.array(list(summary["probabilities"].values()))
  assert probabilities.sum() == pytest.approx(1.0, abs=1e-5)
  serving = tf.saved_model.load(os.path.join(ps_dir, export.EXPORT_DIR))
  served = serving.signatures["serving_default"](
      images=tf.constant(image[None]))["probabilities"].numpy()[0]
  np.testing.assert_allclose(probabilities, served, atol=1e-5)


@pytest.mark.parametrize("override, message", [
    (dict(loop=framework.LoopConfig(train_steps=10, profile_steps=(2, 3))),
     "profile_steps=2,3 is not supported under strategy=parameter_server"),
    (dict(input_mode="per_replica"),
     "input_mode=per_replica is not supported under "
     "strategy=parameter_server"),
    (dict(mixed_precision="float16"),
     "mixed_precision=float16 is not supported under "
     "strategy=parameter_server"),
    (dict(nan_policy="skip"),
     "nan_policy=skip is not supported under strategy=parameter_server"),
    (dict(model_parallel=framework.model_parallel.ModelParallelConfig(
        mode="pipeline")),
     "model_parallel=pipeline is not supported under "
     "strategy=parameter_server"),
])
def test_what_parameter_server_cannot_do_is_a_config_error(tmp_path, override,
                                                          message):
  model_dir = str(tmp_path / "run")
  config = framework.ExperimentConfig(
      model="mlp", dataset="synthetic", model_dir=model_dir,
      strategy="parameter_server", train_steps=10, **override)
  with pytest.raises(framework.ConfigError, match=message):
    experiment.run(config)
  assert not os.path.exists(model_dir)


def test_parameter_server_profile_steps_is_one_line(tmp_path):
  model_dir = str(tmp_path / "run")
  cluster = launcher.local_cluster(2, ps=1)
  proc = run_script(
      "train.py", *cu.MLP, "--strategy=parameter_server", "--train_steps=10",
      "--profile_steps=2,3", f"--model_dir={model_dir}", check=False,
      env={"TF_CONFIG": launcher.tf_config(cluster, "chief", 0)})
  assert proc.returncode == 1, proc.stderr[-3000:]
  [line] = cu.error_lines(proc.stderr)
  assert line.startswith("train.py: error: profile_steps=2,3 is not "
                         "supported under strategy=parameter_server")
  assert not os.path.exists(model_dir)


@pytest.mark.slow
def test_sigterm_to_the_coordinator_saves_through_the_controller(tmp_path):
  model_dir = str(tmp_path / "run")
  cluster = launcher.local_cluster(2, ps=1)
  args = cu.MLP + ["--strategy=parameter_server", "--train_steps=100000",
                   "--steps_per_loop=10", "--checkpoint_every=20",
                   f"--model_dir={model_dir}"]
  servers = [cu.start_task(cluster, role, index, args,
                           str(tmp_path / f"{role}{index}.log"))
             for role, index in (("ps", 0), ("worker", 0), ("worker", 1))]
  try:
    chief = cu.start_task(cluster, "chief", 0, args,
                          str(tmp_path / "chief.log"))
    first = cu.wait_for_checkpoint(model_dir, 20, [chief] + servers)
    chief.send_signal(signal.SIGTERM)
    assert cu.wait_exit(chief, timeout=120) == 42, cu.log_tail(chief)
  finally:
    cu.stop_all(servers + [chief])
  saved = cu.checkpoint_step(model_dir)
  assert saved >= first
  assert cu.global_step(model_dir) == saved
  log = open(tmp_path / "chief.log").read()
  assert f"Preempted: checkpoint saved at step {saved}" in log
