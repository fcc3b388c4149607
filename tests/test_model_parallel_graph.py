"""Pipelines cut from functional models: U-Net, skips across cuts, names."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from framework import model_parallel as mp
from framework.errors import ConfigError
from tests.model_parallel_reference import (DEVICES, STRATEGY,
                                            MicroBatchedTrainer, assert_close,
                                            batches, build, unsplit_gradients)
from tests.helpers import run_script

MICRO = 2


def _segmentation_data(batch, size, classes, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(batch, size, size, 3)).astype(np.float32)
  y = rng.integers(0, classes, size=(batch, size, size)).astype(np.int32)
  return x, y


def _compare(reference, pipeline, x, y, steps, microbatches, atol=1e-5):
  """Gradients, then the weights after every one of `steps` steps, agree."""
  assert_close(pipeline.forward(x), reference.model(x, training=False),
               "forward (stages)")
  ref_grads = tf.function(unsplit_gradients)(
      reference.model, x, y, reference.global_batch_size, microbatches)[0]
  mp_grads = tf.function(pipeline.gradients)(x, y)[0]
  by_variable = {id(v): g for v, g in zip(pipeline.variables, mp_grads)}
  pipeline_vars = pipeline.model.trainable_variables
  assert len(by_variable) == len(ref_grads) == len(pipeline_vars)
  for var, want in zip(pipeline_vars, ref_grads):
    assert_close(by_variable[id(var)], want, f"gradient of {var.path}",
                 atol=atol)
  ref_data, mp_data = batches(x, y), batches(x, y)
  for step in range(1, steps + 1):
    reference.train(ref_data, 1)
    pipeline.train(mp_data, 1)
    for a, b in zip(pipeline.model.weights, reference.model.weights):
      assert_close(a.numpy(), b.numpy(), f"{b.path} after step {step}",
                   atol=atol)


def _unet(seed=1):
  return build("unet", (16, 16, 3), 3, seed=seed, depth=2, width=4)


def test_unet_two_stages_equals_unsplit_microbatched():
  x, y = _segmentation_data(4, 16, 3)
  reference = MicroBatchedTrainer(_unet(), keras.optimizers.Adam(1e-3),
                                  STRATEGY, global_batch_size=4,
                                  num_microbatches=MICRO)
  model = _unet()
  pipeline = mp.PipelineTrainer(model, keras.optimizers.Adam(1e-3), STRATEGY,
                                global_batch_size=4, num_stages=2,
                                num_microbatches=MICRO, devices=DEVICES)
  assert pipeline.model is model  # the model's own layers, not copies
  first, second = pipeline.stages
  # The encoder's skips cross the cut: the decoder stage reads them.
  crossing = [k for k in second.reads if k != id(model.inputs[0])]
  assert len(crossing) >= 2, second.reads
  for stage in pipeline.stages:
    for var in stage.trainable_variables:
      assert mp.variable_device(var) == stage.device, var.path
    for layer in stage.layers:  # BatchNorm statistics move too
      for var in layer.weights:
        assert mp.variable_device(var) == stage.device, var.path
  assert {mp.variable_device(w) for w in model.weights} == set(DEVICES)
  _compare(reference, pipeline, x, y, steps=3, microbatches=MICRO)


def _skip_model(seed=1):
  """a -> b -> c -> d -> add(d, a) -> out: the skip from a crosses 2 cuts."""
  keras.utils.set_random_seed(seed)
  inputs = keras.Input((6,))
  a = keras.layers.Dense(8, activation="tanh", name="a")(inputs)
  b = keras.layers.Dense(8, activation="tanh", name="b")(a)
  c = keras.layers.Dense(8, activation="tanh", name="c")(b)
  d = keras.layers.Dense(8, activation="tanh", name="d")(c)
  joined = keras.layers.Add(name="join")([d, a])
  outputs = keras.layers.Dense(4, name="out")(joined)
  return keras.Model(inputs, outputs, name="skip")


def _skip_pipeline(model, **kwargs):
  kwargs.setdefault("devices", ["/CPU:0", "/CPU:1", "/CPU:0"])
  return mp.PipelineTrainer(model, keras.optimizers.Adam(1e-2), STRATEGY,
                            global_batch_size=8, num_stages=3,
                            num_microbatches=MICRO, **kwargs)


@pytest.mark.parametrize("names, groups, stage_1_reads_a", [
    # a is sent from stage 0 straight to stage 2, past stage 1.
    (("c", "d"), [["a", "b"], ["c"], ["d", "join", "out"]], False),
    # Stage 1 reads a and passes it on: its gradient is the sum of both.
    (("b", "d"), [["a"], ["b", "c"], ["d", "join", "out"]], True),
])
def test_skip_across_two_cuts_by_layer_name_equals_unsplit(
    names, groups, stage_1_reads_a):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(8, 6)).astype(np.float32)
  y = rng.integers(0, 4, size=8).astype(np.int32)
  reference = MicroBatchedTrainer(_skip_model(), keras.optimizers.Adam(1e-2),
                                  STRATEGY, global_batch_size=8,
                                  num_microbatches=MICRO)
  model = _skip_model()
  pipeline = _skip_pipeline(model, stage_boundaries=names)
  assert [[l.name for l in s.layers] for s in pipeline.stages] == groups
  assert pipeline.boundaries == (len(groups[0]),
                                 len(groups[0]) + len(groups[1]))
  key_a = id(model.get_layer("a").output)
  assert key_a in pipeline.stages[1].incoming
  assert (key_a in pipeline.stages[1].reads) == stage_1_reads_a
  assert key_a in pipeline.stages[2].reads
  _compare(reference, pipeline, x, y, steps=4, microbatches=MICRO)


def test_checkpoints_are_interchangeable_with_the_unsplit_model(tmp_path):
  x = np.random.default_rng(0).normal(size=(8, 6)).astype(np.float32)
  y = np.arange(8, dtype=np.int32) % 4
  pipeline = _skip_pipeline(_skip_model(seed=1), stage_boundaries=(2, 4))
  pipeline.train(batches(x, y), 2)
  path = tf.train.Checkpoint(model=pipeline.model).save(
      str(tmp_path / "split"))
  unsplit = _skip_model(seed=2)
  tf.train.Checkpoint(model=unsplit).restore(
      path).assert_existing_objects_matched()
  for a, b in zip(unsplit.weights, pipeline.model.weights):
    assert_close(a.numpy(), b.numpy(), a.path, atol=0)
  # And back: the unsplit checkpoint into a fresh split model.
  path = tf.train.Checkpoint(model=unsplit).save(str(tmp_path / "unsplit"))
  other = _skip_pipeline(_skip_model(seed=3), stage_boundaries=(2, 4))
  tf.train.Checkpoint(model=other.model).restore(
      path).assert_existing_objects_matched()
  assert_close(other.forward(x), unsplit(x), "forward after restore")


@pytest.mark.parametrize("kwargs, message", [
    (dict(stage_boundaries=("b", "nope")),
     "stage_boundaries: no layer is named 'nope'; a name cuts before that "
     "layer; the layers in order are: a, b, c, d, join, out"),
    (dict(stage_boundaries=("d", "b")),
     r"stage_boundaries=\[3, 1\] must be 2 strictly increasing layer "
     r"indices in 1..5"),
    (dict(stage_boundaries=(1, 6)), r"stage_boundaries=\[1, 6\] must be"),
    (dict(stage_boundaries=(2,)), r"stage_boundaries=\[2\] must be 2"),
])
def test_bad_splits_are_one_clear_error(kwargs, message):
  with pytest.raises(ConfigError, match=message) as error:
    _skip_pipeline(_skip_model(), **kwargs)
  assert "\n" not in str(error.value)


def test_more_stages_than_layers_is_one_clear_error():
  with pytest.raises(ConfigError, match="num_stages=7 is more than the "
                     "model's 6 layers; use at most 6 stages"):
    mp.PipelineTrainer(_skip_model(), keras.optimizers.Adam(), STRATEGY,
                       global_batch_size=8, num_stages=7,
                       devices=["/CPU:0"] * 7)


UNET_FLAGS = ["--model=unet", "--dataset=shapes", "--image_size=16",
              "--unet_depth=2", "--unet_width=4", "--cpu_devices=2",
              "--model_parallel=pipeline", "--num_stages=2",
              "--num_microbatches=2", "--global_batch_size=8",
              "--steps_per_loop=2", "--log_every=2",
              "--export_saved_model=false"]


@pytest.mark.slow
def test_train_py_unet_pipeline_cut_at_a_layer_name(tmp_path):
  # The decoder starts at the first transposed convolution: both encoder
  # skips cross the cut.
  proc = run_script("train.py", *UNET_FLAGS, "--train_steps=2",
                    "--stage_boundaries=conv2d_transpose",
                    f"--model_dir={tmp_path}", timeout=600)
  assert "model-parallel memory per device: /CPU:0" in proc.stderr
  assert "mean_iou" in proc.stderr  # the segmentation trainer evaluated
  assert os.path.exists(tmp_path / "ckpt-2.index")
  assert os.path.exists(tmp_path / "model.weights.h5")


def test_train_py_unknown_boundary_name_is_one_line(tmp_path):
  proc = run_script("train.py", *UNET_FLAGS, "--train_steps=2",
                    "--stage_boundaries=decoder", f"--model_dir={tmp_path}",
                    check=False, timeout=300)
  assert proc.returncode == 1 and "Traceback" not in proc.stderr
  errors = [l for l in proc.stderr.splitlines() if l.startswith("train.py:")]
  assert len(errors) == 1, errors
  assert errors[0].startswith("train.py: error: stage_boundaries: no layer "
                              "is named 'decoder'; a name cuts before that "
                              "layer; the layers in order are: conv2d, "), errors
  assert not os.listdir(tmp_path)


def test_every_graph_stage_op_forward_and_backward_is_on_its_device():
  pipeline = _skip_pipeline(_skip_model(), stage_boundaries=("c", "d"))
  step = tf.function(lambda batch: pipeline.strategy.run(
      pipeline.train_step, args=(batch,)))
  graph = step.get_concrete_function(
      (tf.TensorSpec((8, 6), tf.float32),
       tf.TensorSpec((8,), tf.int32))).graph
  devices = {s.name: s.device for s in pipeline.stages}
  offenders = mp.misplaced_ops(
      graph, devices, shared_variables=[pipeline.optimizer.iterations])
  assert not offenders, "\n".join(offenders[:50])
  by_scope = mp.ops_by_scope(graph, devices)
  for scope in devices:  # forward and backward matmuls were checked
    names = [op.name for op in by_scope[scope] if op.type == "MatMul"]
    assert [n for n in names if n.startswith("gradient_tape/")], scope
    assert [n for n in names if not n.startswith("gradient_tape/")], scope
