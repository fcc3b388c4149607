"""The tiny GPT on a mesh with a data axis of 2, its optimizer state sharded
over the copies or not, trained side by side (not a test module: the tests
run it in a fresh process with 4 logical CPU devices)."""

import tempfile

import keras
import numpy as np
import tensorflow as tf

from framework import model_parallel as mp
from framework.core import protocols
from framework.core.trainer import Trainer
from models import gpt_parallel
from tests.transformer_split_reference import (BATCH, flat, relative,
                                               tiny_gpt, token_batches)

STRATEGY = tf.distribute.get_strategy()  # one replica: the mesh's own copies
OPTIMIZERS = {"momentum": lambda: keras.optimizers.SGD(0.5, momentum=0.9),
              "adam": lambda: keras.optimizers.Adam(1e-2)}
# Axis sizes -> TensorParallelTrainer arguments: data:2,model:2 (two copies
# of a 2-way tensor split) and data:2,pipeline:2 (two copies of the GPT's
# blocks cut into 2 stages, one shard each).
MESHES = {"data:2,model:2": dict(num_shards=2, tensor_stages=1),
          "data:2,pipeline:2": dict(num_shards=1, tensor_stages=2)}
# The tiny GPT's blocks on each mesh: one under the tensor split (each
# trainer's step traces in a third less time than with two; the split of a
# block is the same whatever their number), as many as stages under the
# pipeline.
NUM_LAYERS = {"data:2,model:2": 1, "data:2,pipeline:2": 2}
GROUPS = [["/CPU:0", "/CPU:1"], ["/CPU:2", "/CPU:3"]]


def gpt(mesh):
  """The tiny GPT with `mesh`'s block count."""
  return tiny_gpt(num_layers=NUM_LAYERS[mesh])


def make_trainer(mesh, optimizer, shard):
  return mp.TensorParallelTrainer(
      gpt(mesh), OPTIMIZERS[optimizer](), STRATEGY, global_batch_size=BATCH,
      replica_devices=GROUPS, shard_optimizer_state=shard, **MESHES[mesh])


def weights(trainer):
  return flat(trainer.model.logical_weights())


def copy_weights(trainer):
  """Copy 1's weights (the same as copy 0's after every step)."""
  return flat(trainer.copies[0][1].logical_weights())


def slot_bytes(trainer):
  """{device: optimizer slot bytes} over every copy's optimizer."""
  total = {}
  pairs = [(trainer.model, trainer.optimizer)] + [
      (model, optimizer) for _, model, optimizer in trainer.copies]
  for model, optimizer in pairs:
    for device, entry in mp.memory_by_device(model, optimizer).items():
      total[device] = total.get(device, 0) + entry["optimizer_slot_bytes"]
  return total


def batches(steps):
  x, y = token_batches(steps)
  return iter(tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH))


def train(trainer, iterator, steps):
  trainer.train(iterator, steps)
  return trainer


def checkpoint(trainer, folder):
  return tf.train.Checkpoint(
      model=trainer.model,
      optimizer=protocols.checkpointed_optimizer(trainer)).save(
          f"{folder}/ckpt")


def restore(trainer, path):
  tf.train.Checkpoint(
      model=trainer.model,
      optimizer=protocols.checkpointed_optimizer(trainer)).restore(
          path).assert_existing_objects_matched()
  return trainer


def saved_slots(path):
  reader = tf.train.load_checkpoint(path)
  return {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map()
          if k.startswith("optimizer/")}


def run(mesh, optimizer, steps, resume=True):
  """Sharded against unsharded after `steps`: the weights of both copies,
  the slots as checkpoints hold them, slot bytes per device; with `resume`,
  `steps` more from each run's checkpoint with sharding the other way,
  against the unsharded run continued."""
  plain = make_trainer(mesh, optimizer, False)
  start = weights(plain)
  plain_batches = batches(2 * steps)
  train(plain, plain_batches, steps)
  sharded = train(make_trainer(mesh, optimizer, True), batches(2 * steps),
                  steps)
  with tempfile.TemporaryDirectory() as folder:
    paths = {False: checkpoint(plain, folder + "/plain"),
             True: checkpoint(sharded, folder + "/sharded")}
    a, b = saved_slots(paths[False]), saved_slots(paths[True])
    out = {"weights": relative(weights(sharded), weights(plain)),
           "copies": relative(copy_weights(sharded), weights(sharded)),
           "moved": relative(weights(plain), start),
           "slot_keys": len(a) if sorted(a) == sorted(b) else 0,
           "slots": max(relative(b[k], a[k]) if np.any(a[k])
                        else float(np.max(np.abs(b[k]))) for k in a),
           "slot_bytes": {"plain": slot_bytes(plain),
                          "sharded": slot_bytes(sharded)},
           "memory": {"plain": plain.memory, "sharded": sharded.memory},
           "steps": int(sharded.optimizer.iterations.numpy())}
    if not resume:
      return out
    reference = weights(train(plain, plain_batches, steps))
    for name, shard in (("sharded_to_plain", False),
                        ("plain_to_sharded", True)):
      resumed = restore(make_trainer(mesh, optimizer, shard),
                        paths[not shard])
      iterator = batches(2 * steps)
      for _ in range(steps):  # the batches the first half trained on
        next(iterator)
      train(resumed, iterator, steps)
      out[name] = {"weights": relative(weights(resumed), reference),
                   "copies": relative(copy_weights(resumed),
                                      weights(resumed)),
                   "steps": int(resumed.optimizer.iterations.numpy())}
    # The sharded mesh's checkpoint on one device (no mesh, no sharding).
    unsplit = Trainer(gpt(mesh), OPTIMIZERS[optimizer](), STRATEGY,
                      global_batch_size=BATCH)
    unsplit.optimizer.build(unsplit.model.trainable_variables)
    restore(unsplit, paths[True])
    iterator = batches(2 * steps)
    for _ in range(steps):
      next(iterator)
    train(unsplit, iterator, steps)
    out["sharded_to_unsplit"] = {
        "weights": relative(flat(gpt_parallel.logical_weights(unsplit.model)),
                            reference),
        "copies": 0.0, "steps": int(unsplit.optimizer.iterations.numpy())}
  return out
