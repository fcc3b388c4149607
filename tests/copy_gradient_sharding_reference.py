"""ZeRO-2 on a mesh's data axis against ZeRO-1 and unsharded on the same
mesh, with gradient accumulation and clipping (not a test module: the
tests run it in a fresh process with 4 logical CPU devices).

Two meshes: `data:2,model:2` (a GPT of its own size split by tensor, one
block) and `data:2,pipeline:2` (an MLP cut by the Keras-graph pipeline).
"""

import tempfile

import keras
import numpy as np
import tensorflow as tf

from framework import model_parallel as mp
from framework.core import protocols, updates
from framework.core.trainer import Trainer
from models import gpt_parallel
from tests.model_parallel_reference import build
from tests.transformer_split_reference import flat, relative

STRATEGY = tf.distribute.get_strategy()  # one replica: the mesh's own copies
GROUPS = [["/CPU:0", "/CPU:1"], ["/CPU:2", "/CPU:3"]]
BATCH, LENGTH, VOCAB, FEATURES, CLASSES = 8, 12, 48, 10, 6
SEED = 6302
ACCUM, CLIP = 2, 0.05  # the clip acts: the norms here are above it
MODES = {"plain": {}, "zero1": dict(shard_optimizer_state=True),
         "zero2": dict(shard_optimizer_state=True, shard_gradients=True)}


def model(mesh):
  if mesh == "data:2,model:2":
    return build("gpt", (LENGTH,), VOCAB, seed=SEED, num_layers=1,
                 num_heads=2, model_width=24)
  return build("mlp", (FEATURES,), CLASSES, seed=SEED, hidden_units=(20, 14))


def make_trainer(mesh, mode, accum=ACCUM):
  common = dict(global_batch_size=BATCH, replica_devices=GROUPS,
                grad_accum_steps=accum, clip_norm=CLIP, **MODES[mode])
  optimizer = keras.optimizers.Adam(1e-2)
  if mesh == "data:2,model:2":
    return mp.TensorParallelTrainer(model(mesh), optimizer, STRATEGY,
                                    num_shards=2, **common)
  return mp.PipelineTrainer(model(mesh), optimizer, STRATEGY, num_stages=2,
                            **common)


def dataset(mesh, steps):
  rng = np.random.default_rng(SEED)
  if mesh == "data:2,model:2":
    x = rng.integers(0, VOCAB, size=(BATCH * steps, LENGTH)).astype(np.int32)
    y = rng.integers(0, VOCAB, size=(BATCH * steps, LENGTH)).astype(np.int32)
  else:
    x = rng.normal(size=(BATCH * steps, FEATURES)).astype(np.float32)
    y = rng.integers(0, CLASSES, size=BATCH * steps).astype(np.int32)
  return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)


def weights(trainer):
  model = trainer.model
  if hasattr(model, "logical_weights"):
    return flat(model.logical_weights())
  return flat(model.trainable_weights)


def copy_weights(trainer):
  """Copy 1's weights (the same as copy 0's after every step)."""
  model = trainer.copies[0][1]
  if hasattr(model, "logical_weights"):
    return flat(model.logical_weights())
  return flat(model.trainable_weights)


def checkpoint(trainer):
  return tf.train.Checkpoint(
      model=trainer.model,
      optimizer=protocols.checkpointed_optimizer(trainer))


def saved_slots(path):
  reader = tf.train.load_checkpoint(path)
  return {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map()
          if k.startswith("optimizer/")}


def traced(trainer):
  """(what the step's update receives: per call, the gradients' element
  counts; the step's graph): traced once, not run."""
  seen = []
  apply = trainer.updater.apply

  def applied(grads, *args, **kwargs):
    seen.append([int(g.shape.num_elements()) for g in grads])
    return apply(grads, *args, **kwargs)

  trainer.updater.apply = applied
  step = tf.function(trainer.train_step)
  spec = dataset_spec(trainer)
  graph = step.get_concrete_function(spec).graph
  del trainer.updater.apply
  return seen, graph


def dataset_spec(trainer):
  if isinstance(trainer, mp.TensorParallelTrainer):
    return (tf.TensorSpec((BATCH, LENGTH), tf.int32),
            tf.TensorSpec((BATCH, LENGTH), tf.int32))
  return (tf.TensorSpec((BATCH, FEATURES), tf.float32),
          tf.TensorSpec((BATCH,), tf.int32))


def op_counts(graph):
  """{what: count} of the data-axis ops in a traced step."""
  ops = graph.get_operations()
  return {
      "collective_reduce": sum(op.type.startswith("CollectiveReduce")
                               for op in ops),
      "slice_sums": sum(op.type == "AddN" and "sum_gradient_slices/"
                        in op.name for op in ops),
      "accumulate_elements": sum(
          int(op.outputs[0].shape.num_elements()) for op in ops
          if op.type == "AddV2" and "accumulate/" in op.name)}


def run(mesh, steps):
  """Each mode trained `steps`; weights, checkpoint slots, update bytes and
  op counts; ZeRO-2's checkpoint resumed unsharded on the mesh and on one
  device without a split, against the unsharded mesh continued."""
  out = {}
  trained = {}
  with tempfile.TemporaryDirectory() as folder:
    paths = {}
    for mode in MODES:
      trainer = make_trainer(mesh, mode)
      out.setdefault("kinds", {})[mode] = type(trainer.updater).__name__
      seen, graph = traced(trainer)
      out.setdefault("received", {})[mode] = seen
      out.setdefault("ops", {})[mode] = op_counts(graph)
      start = weights(trainer)
      iterator = iter(dataset(mesh, 2 * steps))
      metrics = trainer.train(iterator, steps)
      out.setdefault("grad_norm", {})[mode] = float(metrics["grad_norm"])
      trained[mode] = (trainer, iterator)
      paths[mode] = checkpoint(trainer).save(f"{folder}/{mode}/ckpt")
    # Copy 0's variables' sizes, in the order of the gradients.
    out["variable_elements"] = [int(np.prod(v.shape))
                                for v in trained["plain"][0].variables]
    plain = weights(trained["plain"][0])
    out["moved"] = relative(plain, start)
    slots = {mode: saved_slots(paths[mode]) for mode in MODES}
    for mode in ("zero1", "zero2"):
      trainer = trained[mode][0]
      a, b = slots["plain"], slots[mode]
      out[mode] = {
          "weights": relative(weights(trainer), plain),
          "copies": relative(copy_weights(trainer), weights(trainer)),
          "slot_keys": len(a) if sorted(a) == sorted(b) else 0,
          # [largest |difference|, largest |value|] per slot (the weights
          # the optimizer also saves are compared above, as weights).
          "slots": {k: [float(np.max(np.abs(b[k] - a[k]))),
                        float(np.max(np.abs(a[k])))]
                    for k in a if "_trainable_variables" not in k},
          "steps": int(trainer.optimizer.iterations.numpy())}
    out["zero2_vs_zero1"] = relative(weights(trained["zero2"][0]),
                                     weights(trained["zero1"][0]))
    # The unsharded mesh continued: the reference of both resumes.
    reference_trainer, iterator = trained["plain"]
    reference_trainer.train(iterator, steps)
    reference = weights(reference_trainer)
    resumed = make_trainer(mesh, "plain")
    checkpoint(resumed).restore(
        paths["zero2"]).assert_existing_objects_matched()
    iterator = iter(dataset(mesh, 2 * steps))
    for _ in range(steps):
      next(iterator)
    resumed.train(iterator, steps)
    out["zero2_to_plain"] = {
        "weights": relative(weights(resumed), reference),
        "copies": relative(copy_weights(resumed), weights(resumed)),
        "steps": int(resumed.optimizer.iterations.numpy())}
    unsplit = Trainer(model(mesh), keras.optimizers.Adam(1e-2), STRATEGY,
                      global_batch_size=BATCH, grad_accum_steps=ACCUM,
                      clip_norm=CLIP)
    unsplit.optimizer.build(unsplit.model.trainable_variables)
    tf.train.Checkpoint(
        model=unsplit.model, optimizer=unsplit.optimizer).restore(
            paths["zero2"]).assert_existing_objects_matched()
    iterator = iter(dataset(mesh, 2 * steps))
    for _ in range(steps):
      next(iterator)
    unsplit.train(iterator, steps)
    unsplit_weights = (flat(gpt_parallel.logical_weights(unsplit.model))
                       if mesh == "data:2,model:2"
                       else flat(unsplit.model.trainable_weights))
    out["zero2_to_unsplit"] = {
        "weights": relative(unsplit_weights, reference),
        "steps": int(unsplit.optimizer.iterations.numpy())}
  assert out["kinds"]["zero2"] == updates.CopyShardedGradientsUpdate.__name__
  return out
