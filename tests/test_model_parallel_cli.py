"""`scripts/train.py --model_parallel=...`: train, resume and TensorBoard."""

import glob
import os

import h5py
import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import run_script

COMMON = ["--model=mlp", "--dataset=synthetic", "--cpu_devices=2",
          "--global_batch_size=32", "--steps_per_loop=2",
          "--checkpoint_every=2", "--summary_every=2", "--log_every=2"]


def _train(model_dir, steps, *flags):
  return run_script("train.py", *COMMON, f"--model_dir={model_dir}",
                    f"--train_steps={steps}", *flags)


def _weights(model_dir):
  """{dataset path: array} of the final model.weights.h5."""
  values = {}
  with h5py.File(os.path.join(model_dir, "model.weights.h5"), "r") as f:
    f.visititems(lambda name, item: values.__setitem__(name, item[()])
                 if isinstance(item, h5py.Dataset) else None)
  return values


def _scalar_tags(logdir):
  tags = {}
  for path in glob.glob(os.path.join(logdir, "events.out.tfevents.*")):
    for event in tf.compat.v1.train.summary_iterator(path):
      for value in event.summary.value:
        if value.tensor.dtype == tf.string.as_datatype_enum:
          continue  # the flags table
        tags.setdefault(value.tag, []).append(
            (event.step, float(tf.make_ndarray(value.tensor))))
  return tags


@pytest.mark.slow
def test_pipeline_trains_resumes_exactly_and_writes_tensorboard(tmp_path):
  flags = ["--model_parallel=pipeline", "--num_stages=2",
           "--num_microbatches=4"]
  straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
  _train(straight, 6, *flags)
  first = _train(resumed, 4, *flags)
  assert "model-parallel memory per device: /" in first.stderr
  second = _train(resumed, 6, *flags)
  assert "Restored checkpoint" in second.stderr and "ckpt-4" in second.stderr
  assert os.path.exists(os.path.join(resumed, "ckpt-6.index"))
  # 4 steps + resume to 6 == 6 steps straight, weight for weight.
  want, got = _weights(straight), _weights(resumed)
  assert sorted(want) == sorted(got) and want
  for name in want:
    np.testing.assert_array_equal(got[name], want[name], err_msg=name)
  # TensorBoard: losses for every summary step and each device's memory.
  tags = _scalar_tags(os.path.join(resumed, "train"))
  assert sorted(step for step, _ in tags["loss"]) == [2, 4, 6]
  memory = {tag: values for tag, values in tags.items()
            if tag.startswith("memory/")}
  devices = {tag.split("/")[1] for tag in memory}
  assert len(devices) == 2, sorted(memory)  # CPU_0, CPU_1 (or GPU_0, GPU_1)
  for device in devices:
    for key in ("param_bytes", "optimizer_slot_bytes"):
      values = [v for _, v in memory[f"memory/{device}/{key}"]]
      assert values and all(v > 0 for v in values), (device, key)
  assert os.listdir(os.path.join(resumed, "eval"))


@pytest.mark.slow
def test_tensor_parallel_trains_and_resumes(tmp_path):
  flags = ["--model_parallel=tensor", "--hidden_units=10"]
  model_dir = str(tmp_path / "tensor")
  _train(model_dir, 2, *flags)
  second = _train(model_dir, 4, *flags)
  assert "Restored checkpoint" in second.stderr and "ckpt-2" in second.stderr
  assert os.path.exists(os.path.join(model_dir, "ckpt-4.index"))
  tags = _scalar_tags(os.path.join(model_dir, "train"))
  assert sorted(step for step, _ in tags["loss"]) == [2, 4]
  assert [t for t in tags if t.endswith("_1/param_bytes")], sorted(tags)


def test_microbatches_not_dividing_the_batch_is_one_line_error(tmp_path):
  proc = run_script("train.py", *COMMON, f"--model_dir={tmp_path}",
                    "--train_steps=2", "--model_parallel=pipeline",
                    "--num_microbatches=3", check=False)
  assert proc.returncode == 1
  assert "Traceback" not in proc.stderr
  errors = [l for l in proc.stderr.splitlines() if l.startswith("train.py:")]
  assert errors == ["train.py: error: num_microbatches=3 does not divide "
                    "global_batch_size=32; use a divisor of 32"], errors
