"""train.py on a gpt pipeline mesh runs the gpt's own split and equals the
unsplit run; a mesh run relaunched on another mesh (or none), and an
unsplit one on a mesh, goes on as one continuous unsplit run would: the
weights, Adam's slots and the loss, within 1e-5. The relaunch says the
split changed in one line; so does an MLP's Dense pair split resumed
unsplit.

Every run is checked against one continuous unsplit run of 2K steps.
"""

import json
import os
import shutil

import numpy as np
import pytest
import tensorflow as tf

from framework import _tf_internal
from tests import helpers

pytestmark = pytest.mark.slow

GPT = ["--model=gpt", "--dataset=text", "--global_batch_size=8",
       "--sequence_length=16", "--model_width=32", "--num_heads=4",
       "--num_layers=2", "--steps_per_loop=2", "--eval_steps=1",
       "--noexport_saved_model"]
K = 2  # steps before the relaunch; 2K in all
TOLERANCE = 1e-5
DEVICES = {"": 1, "pipeline:2": 2, "model:2": 2, "data:2,model:2": 4,
           "data:2,pipeline:2": 4}


def _train(model_dir, steps, mesh):
  flags = [f"--mesh={mesh}"] if mesh else []
  return helpers.run_script(
      "train.py", *GPT, f"--model_dir={model_dir}", f"--train_steps={steps}",
      f"--cpu_devices={DEVICES[mesh]}", *flags, timeout=900)


def _state(model_dir):
  """{list: [arrays]} of the latest checkpoint's optimizer lists (the
  weights it was built on and Adam's two slots), by object path."""
  reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(model_dir))
  graph = _tf_internal.checkpoint_object_graph(reader)

  def child(node, name):
    return graph.nodes[next(c.node_id for c in graph.nodes[node].children
                            if c.local_name == name)]

  optimizer = next(c.node_id for c in graph.nodes[0].children
                   if c.local_name == "optimizer")
  out = {}
  for name in ("_trainable_variables", "_momentums", "_velocities"):
    items = child(optimizer, name).children
    out[name] = [reader.get_tensor(graph.nodes[c.node_id].attributes[0]
                                   .checkpoint_key)
                 for c in sorted(items, key=lambda c: int(c.local_name))]
  return out, sorted(reader.get_variable_to_shape_map())


def _relative(a, b):
  a, b = (np.concatenate([np.ravel(x) for x in v]).astype(np.float64)
          for v in (a, b))
  return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _differences(proc, model_dir, reference):
  """{what: max relative difference} against the continuous run."""
  (want, want_keys), want_loss = reference
  state, keys = _state(model_dir)
  assert keys == want_keys  # the same checkpoint keys on every mesh
  out = {name: _relative(state[name], want[name]) for name in want}
  out["loss"] = abs(helpers.final_eval(proc.stderr)["loss"] - want_loss) / (
      want_loss)
  return out


def _check(differences):
  print("max relative differences:", differences)  # shown with -s
  assert max(differences.values()) < TOLERANCE, differences


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """(checkpoint state, keys), final eval loss of 2K unsplit steps."""
  model_dir = tmp_path_factory.mktemp("unsplit") / "run"
  proc = _train(model_dir, 2 * K, "")
  return _state(model_dir), helpers.final_eval(proc.stderr)["loss"]


@pytest.fixture(scope="module")
def first_half(tmp_path_factory):
  """{mesh: model_dir} after K steps, copied by each test that goes on."""
  dirs = {}
  for mesh in ("data:2,model:2", ""):
    dirs[mesh] = tmp_path_factory.mktemp("first") / (mesh or "none")
    _train(dirs[mesh], K, mesh)
  return dirs


def _info(model_dir):
  with open(os.path.join(model_dir, "model_info.json")) as f:
    return json.load(f)


def test_a_gpt_data_by_pipeline_mesh_runs_its_split_and_equals_unsplit(
    tmp_path, reference):
  model_dir = tmp_path / "run"
  proc = _train(model_dir, 2 * K, "data:2,pipeline:2")
  assert ("its 2-stage pipeline runs as TensorParallelLanguageModel"
          "Trainer(num_shards=1, tensor_stages=2)") in proc.stderr
  split = _info(model_dir)["run_plan"]["model_parallel"]
  assert (split["mode"], split["trainer"]) == (
      "pipeline", "TensorParallelLanguageModelTrainer")
  _check(_differences(proc, model_dir, reference))


@pytest.mark.parametrize("first, then", [
    ("data:2,model:2", ""),                # mesh -> none
    ("data:2,model:2", "pipeline:2"),      # mesh -> another mesh
    ("", "data:2,model:2"),                # none -> mesh
])
def test_a_run_resumes_on_another_mesh_as_one_continuous_unsplit_run(
    tmp_path, reference, first_half, first, then):
  model_dir = tmp_path / "run"
  shutil.copytree(first_half[first], model_dir)
  proc = _train(model_dir, 2 * K, then)
  was = f"mesh={first}" if first else "none"
  now = f"mesh={then}" if then else "none"
  lines = [l for l in proc.stderr.splitlines()
           if "model split changed" in l]
  assert len(lines) == 1, proc.stderr[-3000:]
  assert f"model split changed: was {was}, now {now}" in lines[0]
  assert f"resuming at step {K}" in lines[0]
  assert _info(model_dir)["config_changes"] == [
      {"step": K, "model_parallel": {"was": was, "now": now}}]
  _check(_differences(proc, model_dir, reference))


def test_a_dense_pair_split_resumes_unsplit(tmp_path):
  mlp = ["--model=mlp", "--dataset=synthetic", "--global_batch_size=32",
         "--steps_per_loop=2", "--eval_steps=1", "--noexport_saved_model",
         f"--model_dir={tmp_path / 'run'}"]
  helpers.run_script("train.py", *mlp, "--train_steps=2",
                     "--model_parallel=tensor", "--num_shards=2",
                     "--cpu_devices=2")
  proc = helpers.run_script("train.py", *mlp, "--train_steps=4")
  assert "model split changed: was model_parallel=tensor num_shards=2" in (
      proc.stderr)
  # Equal to an unsplit run: tests/test_dense_pair_checkpoint_keys.py.
