"""Pipeline parallelism equals the unsplit model, and is placed per stage."""

import keras
import pytest
import tensorflow as tf

import framework
from framework import model_parallel as mp
from framework.errors import ConfigError
from tests.model_parallel_reference import (DEVICES, STRATEGY,
                                            MicroBatchedTrainer,
                                            assert_close, batches, build,
                                            data, unsplit_gradients)

BATCH, STAGES, MICRO = 16, 2, 4
ADAM_STEPS = 5


def _pipeline(model, **kwargs):
  kwargs.setdefault("num_stages", STAGES)
  kwargs.setdefault("num_microbatches", MICRO)
  kwargs.setdefault("global_batch_size", BATCH)
  kwargs.setdefault("devices", DEVICES)
  return mp.PipelineTrainer(model, keras.optimizers.Adam(1e-2), STRATEGY,
                            **kwargs)


def _check_equal(reference, pipeline, x, y, reference_microbatches=1):
  """Forward, first gradients and weights after ADAM_STEPS steps agree."""
  assert_close(pipeline.forward(x), reference.model(x, training=False),
               "forward (stages)")
  assert_close(pipeline.model(x), reference.model(x, training=False),
               "forward (model)")
  ref_grads = tf.function(unsplit_gradients)(
      reference.model, x, y, reference.global_batch_size,
      reference_microbatches)[0]
  mp_grads = tf.function(pipeline.gradients)(x, y)[0]
  assert len(ref_grads) == len(mp_grads)
  for var, a, b in zip(reference.model.trainable_variables, mp_grads,
                       ref_grads):
    assert_close(a, b, f"gradient of {var.path}")
  reference.train(batches(x, y), ADAM_STEPS)
  pipeline.train(batches(x, y), ADAM_STEPS)
  assert len(reference.model.weights) == len(pipeline.model.weights)
  for a, b in zip(pipeline.model.weights, reference.model.weights):
    assert_close(a.numpy(), b.numpy(), f"{b.path} after {ADAM_STEPS} steps")


def test_mlp_two_stages_four_microbatches_equals_unsplit_trainer():
  x, y = data(BATCH, (12,), 5)
  # No BatchNorm: the unsplit reference is the plain full-batch Trainer.
  reference = framework.Trainer(
      build("mlp", (12,), 5, hidden_units=(16, 16)),
      keras.optimizers.Adam(1e-2), STRATEGY, global_batch_size=BATCH)
  pipeline = _pipeline(build("mlp", (12,), 5, hidden_units=(16, 16)))
  assert [len(s.layers) for s in pipeline.stages] == [2, 2]
  _check_equal(reference, pipeline, x, y)


def test_cifar_cnn_without_dropout_equals_unsplit_microbatched():
  x, y = data(8, (32, 32, 3), 10)
  # BatchNorm normalises each micro-batch: the reference accumulates the
  # same 4 micro-batches, unsplit, on one device.
  reference = MicroBatchedTrainer(
      build("cifar_cnn", (32, 32, 3), 10, dropout=False),
      keras.optimizers.Adam(1e-3), STRATEGY, global_batch_size=8,
      num_microbatches=MICRO)
  pipeline = mp.PipelineTrainer(
      build("cifar_cnn", (32, 32, 3), 10, dropout=False),
      keras.optimizers.Adam(1e-3), STRATEGY, global_batch_size=8,
      num_stages=STAGES, num_microbatches=MICRO, stage_boundaries=(5,),
      devices=DEVICES)
  _check_equal(reference, pipeline, x, y, reference_microbatches=MICRO)


def _trace_step(trainer, x, y):
  step = tf.function(lambda batch: trainer.strategy.run(trainer.train_step,
                                                        args=(batch,)))
  return step.get_concrete_function(
      (tf.TensorSpec(x.shape, tf.float32), tf.TensorSpec(y.shape,
                                                          tf.int32))).graph


def test_every_stage_op_forward_backward_and_update_is_on_its_device():
  x, y = data(BATCH, (12,), 5)
  pipeline = _pipeline(build("mlp", (12,), 5, hidden_units=(16, 16)))
  graph = _trace_step(pipeline, x, y)
  devices = {s.name: s.device for s in pipeline.stages}
  assert devices == {"stage_0": "/CPU:0", "stage_1": "/CPU:1"}
  # The optimizer math of each stage's variables (Adam) runs there too.
  updates = {mp.update_scope(d): d for d in devices.values()}
  # (Adam reads its step counter, on device 0, from every update.)
  offenders = mp.misplaced_ops(graph, {**devices, **updates},
                               shared_variables=[pipeline.optimizer.iterations])
  assert not offenders, "ops off their stage's device:\n" + "\n".join(
      offenders[:50])
  # The check saw forward and backward ops (matmuls and their gradients) of
  # every stage and every micro-batch.
  by_scope = mp.ops_by_scope(graph, devices)
  for scope in devices:
    names = [op.name for op in by_scope[scope] if op.type == "MatMul"]
    forward = [n for n in names if not n.startswith("gradient_tape/")]
    backward = [n for n in names if n.startswith("gradient_tape/")]
    assert len(forward) >= MICRO and len(backward) >= 2 * MICRO, names
  for scope, ops in mp.ops_by_scope(graph, updates).items():
    assert len(ops) > 20, scope  # the Adam updates were found and checked
  # Every matmul in the step belongs to a stage: none escaped placement.
  matmuls = [op for op in graph.get_operations() if op.type == "MatMul"]
  unplaced = [op.name for op in matmuls
              if mp.short_device(op.device) not in devices.values()]
  assert not unplaced, unplaced
  # Variables and their Adam slots live on their stage's device.
  for stage in pipeline.stages:
    for var in stage.trainable_variables:
      assert mp.variable_device(var) == stage.device, var.path
  slots = [v for v in pipeline.optimizer.variables if "_momentum" in v.path
           or "_velocity" in v.path]
  assert {mp.variable_device(v) for v in slots} == {"/CPU:0", "/CPU:1"}
  for var in pipeline.model.trainable_variables:
    for slot in slots:
      if slot.shape == var.shape and var.path.replace("/", "_").endswith(
          slot.path.split("/")[-1].rsplit("_", 1)[0]):
        assert mp.variable_device(slot) == mp.variable_device(var)


def test_balanced_split_halves_params_and_slots_per_device():
  # Flatten, Dense 144, Dense 272 | Dense 272, Dense 136 parameters.
  unsplit = build("mlp", (8,), 8, hidden_units=(16, 16, 16))
  optimizer = keras.optimizers.Adam()
  optimizer.build(unsplit.trainable_variables)
  (total,) = mp.memory_by_device(unsplit, optimizer).values()
  pipeline = _pipeline(build("mlp", (8,), 8, hidden_units=(16, 16, 16)))
  assert pipeline.boundaries == (3,)
  per_device = pipeline.memory
  assert list(per_device) == ["/CPU:0", "/CPU:1"]
  for key in ("param_bytes", "optimizer_slot_bytes"):
    whole = total[key]
    parts = [per_device[d][key] for d in per_device]
    assert sum(parts) == whole, (key, parts, whole)
    for part in parts:
      assert 0.45 <= part / whole <= 0.55, (key, parts, whole)
  # Adam keeps two slots per parameter, next to the parameter.
  for entry in per_device.values():
    assert entry["optimizer_slot_bytes"] == 2 * entry["param_bytes"]
  metrics = mp.memory_metrics(per_device)
  assert metrics["memory/CPU_1/param_bytes"] == per_device["/CPU:1"][
      "param_bytes"]


def test_balanced_boundaries_minimise_the_largest_stage():
  assert mp.balanced_boundaries([0, 144, 272, 272, 136], 2) == (3,)
  assert mp.balanced_boundaries([5, 1, 1, 1, 5], 3) == (1, 4)
  assert mp.balanced_boundaries([1, 1], 2) == (1,)


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_stages=5), "more than the model's 4 layers"),
    (dict(num_stages=3, devices=None), "needs 3 devices but only 2"),
    (dict(num_microbatches=3), "does not divide global_batch_size=16"),
    (dict(stage_boundaries=(4,)), "stage_boundaries=[4] must be"),
])
def test_invalid_splits_are_one_clear_error(kwargs, message):
  with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace(
      "]", r"\]")):
    _pipeline(build("mlp", (12,), 5, hidden_units=(16, 16)), **kwargs)


def test_model_parallelism_needs_one_replica():
  mirrored = tf.distribute.MirroredStrategy(["/CPU:0", "/CPU:1"])
  with mirrored.scope():
    model = build("mlp", (12,), 5, hidden_units=(16, 16))
    optimizer = keras.optimizers.Adam()
  with pytest.raises(ConfigError, match="one replica"):
    mp.PipelineTrainer(model, optimizer, mirrored, global_batch_size=BATCH,
                       num_stages=2, devices=DEVICES)


def test_unsplit_checkpoint_restores_into_the_placed_model(tmp_path):
  unsplit = build("mlp", (12,), 5, hidden_units=(16, 16), seed=1)
  other = build("mlp", (12,), 5, hidden_units=(16, 16), seed=2)
  placed, _ = mp.place_sequential(other, mp.split_layers(other.layers, 2),
                                  DEVICES)
  path = tf.train.Checkpoint(model=unsplit).save(str(tmp_path / "ckpt"))
  tf.train.Checkpoint(model=placed).restore(
      path).assert_existing_objects_matched()
  for want, got in zip(unsplit.weights, placed.weights):
    assert_close(got.numpy(), want.numpy(), want.path, atol=0)
  assert [mp.variable_device(w) for w in placed.weights] == [
      "/CPU:0", "/CPU:0", "/CPU:1", "/CPU:1", "/CPU:1", "/CPU:1"]
