"""scripts/train.py end to end in fresh processes: resume, TensorBoard, errors."""

import glob
import os
import re

import h5py
import numpy as np
import pytest
from tensorboard.backend.event_processing import event_accumulator

import helpers
from helpers import run_script

COMMON = ["--model=mlp", "--dataset=synthetic", "--hidden_units=16",
          "--global_batch_size=32", "--optimizer=momentum",
          "--learning_rate=0.05"]


def train(model_dir, *args, check=True, env=None):
  return run_script("train.py", *COMMON, f"--model_dir={model_dir}", *args,
                    check=check, env=env)


def weights(model_dir):
  with h5py.File(os.path.join(model_dir, "model.weights.h5")) as f:
    arrays = []
    f.visititems(lambda name, obj: arrays.append((name, obj[()]))
                 if isinstance(obj, h5py.Dataset) else None)
  return dict(arrays)


def events(logdir):
  acc = event_accumulator.EventAccumulator(
      logdir, size_guidance={event_accumulator.TENSORS: 0})
  acc.Reload()
  return acc


def scalars(acc, tag):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  return {e.step: float(tf.make_ndarray(e.tensor_proto))
          for e in acc.Tensors(tag)}


def files(model_dir):
  return {p: os.path.getmtime(p) for p in glob.glob(f"{model_dir}/**",
                                                     recursive=True)}


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
  model_dir = tmp_path_factory.mktemp("straight")
  train(model_dir, "--strategy=mirrored", "--cpu_devices=2",
        "--train_steps=20", "--steps_per_loop=4", "--summary_every=2",
        "--eval_every=10", "--checkpoint_every=10", "--log_every=5")
  return model_dir


@pytest.mark.slow
def test_resume_gives_identical_weights(straight_run, tmp_path):
  flags = ["--strategy=mirrored", "--cpu_devices=2", "--steps_per_loop=4",
           "--checkpoint_every=10"]
  train(tmp_path, *flags, "--train_steps=10")
  proc = train(tmp_path, *flags, "--train_steps=20")
  assert "Restored checkpoint" in proc.stderr
  expected, resumed = weights(straight_run), weights(tmp_path)
  assert expected.keys() == resumed.keys() and expected
  for name in expected:
    np.testing.assert_array_equal(expected[name], resumed[name])


def test_tensorboard_tags_and_steps(straight_run):
  train_events = events(os.path.join(straight_run, "train"))
  for tag in ("loss", "accuracy", "learning_rate", "examples_per_second",
              "steps_per_second", "grad_norm"):
    assert sorted(scalars(train_events, tag)) == list(range(2, 21, 2)), tag
  assert scalars(train_events, "learning_rate")[20] == pytest.approx(0.05)
  assert "flags" in train_events.Tags()["tensors"]
  flags_text = train_events.Tensors("flags")[0].tensor_proto.string_val[0]
  assert b"| strategy | mirrored |" in flags_text
  eval_events = events(os.path.join(straight_run, "eval"))
  assert sorted(scalars(eval_events, "loss")) == [10, 20]
  assert sorted(scalars(eval_events, "accuracy")) == [10, 20]


def test_summaries_are_reduced_over_replicas(tmp_path):
  # Per-step losses on 2 replicas equal one device's on the same global
  # batches; replica 0's share alone would be about half.
  losses = {}
  for strategy in ("one_device", "mirrored"):
    model_dir = tmp_path / strategy
    train(model_dir, f"--strategy={strategy}", "--cpu_devices=2",
          "--train_steps=3", "--summary_every=1")
    losses[strategy] = scalars(events(os.path.join(model_dir, "train")),
                               "loss")
  assert sorted(losses["mirrored"]) == [1, 2, 3]
  for step, loss in losses["one_device"].items():
    assert losses["mirrored"][step] == pytest.approx(loss, abs=1e-5)


@pytest.mark.slow
def test_flagfile_and_epochs(tmp_path):
  flagfile = tmp_path / "run.cfg"
  flagfile.write_text("\n".join(COMMON + ["--strategy=central_storage",
                                          "--cpu_devices=2", "--epochs=2",
                                          f"--model_dir={tmp_path / 'run'}"]))
  proc = run_script("train.py", f"--flagfile={flagfile}")
  # 2048 synthetic examples / 32 = 64 steps per epoch.
  assert "train step 128/128" in proc.stderr
  assert os.path.exists(tmp_path / "run" / "ckpt-128.index")
  # --epochs=0 unsets the flag file's --epochs so --train_steps can replace it.
  proc = run_script("train.py", f"--flagfile={flagfile}", "--epochs=0",
                    "--train_steps=130", "--steps_per_loop=2")
  assert "train step 130/130" in proc.stderr


def test_custom_step_example_trains(tmp_path):
  proc = run_script("examples/custom_step.py", *COMMON, "--strategy=mirrored",
                    "--cpu_devices=2", "--train_steps=30",
                    f"--model_dir={tmp_path}", "--label_smoothing=0.1",
                    "--gradient_penalty=0.001")
  final = [l for l in proc.stderr.splitlines() if "final eval" in l][0]
  assert "'accuracy': " in final
  assert float(final.split("'accuracy': ")[1].split(",")[0]) > 0.5
  assert "penalty" in events(os.path.join(tmp_path, "train")).Tags()[
      "tensors"]


def assert_one_line_error(proc, *fragments, unchanged=None):
  """Exactly one `train.py: error: ...` line with `fragments`, exit 1, no
  traceback (and `unchanged`, a helpers.snapshot, still as it was)."""
  return helpers.assert_one_line_error(proc, "train.py", *fragments,
                                       unchanged=unchanged)


@pytest.mark.parametrize("args,fragments", [
    (["--strategy=nccl"], ["--strategy"]),
    (["--model=resnet"], ["model='resnet'", "cifar_cnn, gpt, mlp"]),
    (["--optimizer=lamb"], ["--optimizer"]),
    (["--global_batch_size=33", "--strategy=mirrored", "--cpu_devices=2"],
     ["global_batch_size=33", "2 replicas"]),
    (["--train_steps=0"], ["train_steps", "epochs"]),  # 0: unset
    (["--train_steps=-3"], ["train_steps=-3", "positive"]),
    (["--global_batch_size=0"], ["global_batch_size=0", "positive"]),
    (["--cpu_devices=0"], ["--cpu_devices"]),
    (["--train_steps=5", "--epochs=2"], ["train_steps", "epochs"]),
    (["--strategy=multi_worker_mirrored"], ["needs TF_CONFIG"]),
    (["--profile_steps=5,3"], ["profile_steps=(5, 3)", "first <= last"]),
    (["--profile_steps=x"], ["profile_steps='x'", "integers"]),
    (["--dataset=cifar10", "--data_dir=/nonexistent/cifar"],
     ["/nonexistent/cifar", "data_batch_1"]),
])
def test_bad_input_is_one_line(straight_run, args, fragments):
  before = files(straight_run)
  full = ["--train_steps=40"] + args if "--train_steps" not in str(
      args) and "--epochs" not in str(args) else args
  unchanged = helpers.snapshot(straight_run)
  proc = train(straight_run, *full, check=False,
               env={"TF_CONFIG": None})
  assert_one_line_error(proc, *fragments, unchanged=unchanged)
  assert files(straight_run) == before  # nothing in model_dir lost or touched


def test_malformed_tf_config_is_one_line(tmp_path):
  proc = train(tmp_path, "--strategy=multi_worker_mirrored",
               "--train_steps=5", check=False, env={"TF_CONFIG": "{oops"})
  assert_one_line_error(proc, "TF_CONFIG is not valid JSON")


def test_checkpoint_of_another_model_is_an_error(straight_run, tmp_path):
  before = files(straight_run)
  proc = train(straight_run, "--train_steps=40", "--hidden_units=8",
               check=False)
  assert_one_line_error(proc, "does not match this model")
  assert files(straight_run) == before


def test_missing_state_file_is_an_error(tmp_path):
  # A garbled one is rebuilt from the files (test_checkpoint_state_garbled).
  train(tmp_path, "--train_steps=4")
  (tmp_path / "checkpoint").unlink()
  proc = train(tmp_path, "--train_steps=8", check=False)
  assert_one_line_error(proc, "state file is missing")
  assert os.path.exists(tmp_path / "ckpt-4.index")


def test_orphaned_temporary_checkpoints_are_removed(tmp_path):
  train(tmp_path, "--train_steps=4")
  orphans = [tmp_path / "ckpt-9_temp", tmp_path / ".tmp_worker_worker_1"]
  for orphan in orphans:
    orphan.mkdir()
    (orphan / "part-00000").write_text("half-written")
  train(tmp_path, "--train_steps=6")
  assert not any(o.exists() for o in orphans)


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path):
  train(tmp_path, "--train_steps=10", "--checkpoint_every=10")
  before = files(tmp_path)
  proc = train(tmp_path, "--train_steps=40", "--learning_rate=1e30",
               "--optimizer=sgd", "--allow_config_change", "--steps_per_loop=5",
               "--checkpoint_every=5", check=False)
  assert_one_line_error(proc, "loss is", "ckpt-10")
  after = files(tmp_path)
  ckpts = lambda f: {p: t for p, t in f.items() if "ckpt" in p or
                     p.endswith("checkpoint")}
  assert ckpts(after) == ckpts(before)


# train.py with a Trainer whose gradient is NaN at steps 5 and 6 (global
# step 4 and 5 before they run); the loss stays finite.
NAN_AT_STEPS_5_6 = """
import sys
sys.path.insert(0, {root!r})
import numpy as np
import tensorflow as tf
from absl import app
from framework.core.trainer import Trainer
from scripts import cli, train

class NanGradients(Trainer):
  def compute_gradients(self, batch):
    grads, metrics = super().compute_gradients(batch)
    bad = tf.logical_and(self.global_step >= 4, self.global_step < 6)
    return [g + tf.where(bad, np.nan, 0.0) for g in grads], metrics

app.run(cli.main_running(lambda: train.run_main(NanGradients)))
"""


def checkpoint(model_dir, step):
  """{name: array} of the checkpoint of `step`."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  reader = tf.train.load_checkpoint(os.path.join(model_dir, f"ckpt-{step}"))
  return {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map()
          if "OPTIMIZER_SLOT" not in k}


def test_nan_policy_skip_keeps_training(tmp_path):
  script = tmp_path / "nan_train.py"
  script.write_text(NAN_AT_STEPS_5_6.format(
      root=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
  model_dir = tmp_path / "run"
  proc = run_script(str(script), *COMMON, f"--model_dir={model_dir}",
                    "--nan_policy=skip", "--train_steps=12",
                    "--steps_per_loop=2", "--checkpoint_every=2",
                    "--keep_checkpoints=10", "--summary_every=2",
                    "--log_every=2")
  # The skipped steps changed no weight and did not advance the optimizer.
  at4, at6, at12 = (checkpoint(model_dir, s) for s in (4, 6, 12))
  # Keras 3 checkpoints list the weights under the optimizer.
  weight_names = [k for k in at4 if "/_trainable_variables/" in k]
  assert weight_names, sorted(at4)
  for name in weight_names:
    np.testing.assert_array_equal(at4[name], at6[name])
    assert not np.array_equal(at6[name], at12[name]) or "bias" in name
  [iterations] = [k for k in at4 if "iterations" in k]
  assert [int(c[iterations]) for c in (at4, at6, at12)] == [4, 4, 10]
  assert int(at12["global_step/.ATTRIBUTES/VARIABLE_VALUE"]) == 12
  # Counted in the log and in TensorBoard.
  assert "train step 4/12: " in proc.stderr
  assert re.search(r"train step 6/12: .* skipped_steps=2", proc.stderr)
  assert re.search(r"train step 12/12: .* skipped_steps=2", proc.stderr)
  skipped = scalars(events(os.path.join(model_dir, "train")), "skipped_steps")
  assert skipped == {2: 0, 4: 0, 6: 2, 8: 2, 10: 2, 12: 2}
  assert all(np.isfinite(w).all() for w in weights(model_dir).values())


def test_diverged_skipping_stops_after_max_skipped_steps(tmp_path):
  # SGD at 1e30: one step diverges the weights, every later loss is NaN.
  train(tmp_path, "--train_steps=20", "--checkpoint_every=10")
  before = files(tmp_path)
  weights_file = os.path.join(tmp_path, "model.weights.h5")
  proc = train(tmp_path, "--train_steps=200", "--learning_rate=1e30",
               "--optimizer=sgd", "--allow_config_change", "--nan_policy=skip",
               "--steps_per_loop=5",
               "--checkpoint_every=5", "--keep_checkpoints=2",
               "--summary_every=1", "--max_skipped_steps=10", check=False)
  assert proc.returncode == 1
  assert_one_line_error(proc, "10 steps in a row were skipped",
                        "max_skipped_steps=10", "ckpt-20")
  # The good checkpoints stay, nothing diverged was saved, the weights
  # file is the good run's.
  kept = lambda f: {p: t for p, t in f.items() if "ckpt" in p or p.endswith(
      ("checkpoint", ".h5")) or "/export" in p}
  after = files(tmp_path)
  assert kept(after) == kept(before) and weights_file in kept(after)
  # The skipped steps were counted in TensorBoard.
  skipped = scalars(events(os.path.join(tmp_path, "train")), "skipped_steps")
  assert max(skipped.values()) > 0


def test_max_skipped_steps_must_be_positive(tmp_path):
  proc = train(tmp_path, "--train_steps=5", "--max_skipped_steps=0",
               check=False)
  assert_one_line_error(proc, "max_skipped_steps=0 must be a positive "
                        "integer")


@pytest.mark.slow
def test_resume_with_dropout_draws_the_same_masks(tmp_path):
  # The dropout random state is checkpointed with the weights.
  flags = ["--model=cifar_cnn", "--dataset=synthetic", "--global_batch_size=16",
           "--steps_per_loop=2"]
  run_script("train.py", *flags, "--train_steps=4",
             f"--model_dir={tmp_path / 'straight'}")
  run_script("train.py", *flags, "--train_steps=2",
             f"--model_dir={tmp_path / 'resumed'}")
  run_script("train.py", *flags, "--train_steps=4",
             f"--model_dir={tmp_path / 'resumed'}")
  expected, resumed = (weights(tmp_path / d) for d in ("straight", "resumed"))
  for name in expected:
    np.testing.assert_array_equal(expected[name], resumed[name])
