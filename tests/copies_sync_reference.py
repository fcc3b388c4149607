"""What the copies' sync (`PipelineCopies.sync_copies`, ZeRO-3's
`CopyParameterSharding.load`) moves on a `data:2,pipeline:2` mesh, and
that a change of copy 0 between train calls reaches every copy (not a
test module: the tests run it in a fresh process with 4 logical CPU
devices).
"""

import glob
import tempfile

import keras
import numpy as np
import tensorflow as tf
from tensorflow.tsl.profiler.protobuf import xplane_pb2  # pylint: disable=g-direct-tensorflow-import

from framework import model_parallel as mp
from framework.core import protocols

STRATEGY = tf.distribute.get_strategy()  # one replica: the mesh's own copies
GROUPS = [["/CPU:0", "/CPU:1"], ["/CPU:2", "/CPU:3"]]
BATCH, FEATURES, CLASSES = 16, 9, 5
SEED = 5077
MODES = {"plain": {},
         "zero3": dict(shard_optimizer_state=True, shard_gradients=True,
                       shard_parameters=True)}


def model():
  """Dense, Dropout, Dense, Dense (no BatchNormalization: each copy's
  statistics are its own, and the sync sets them to copy 0's)."""
  keras.utils.set_random_seed(SEED)
  x = inputs = keras.Input((FEATURES,))
  for layer in (keras.layers.Dense(13, activation="relu"),
                keras.layers.Dropout(0.3, seed=SEED),
                keras.layers.Dense(11, activation="relu"),
                keras.layers.Dense(CLASSES)):
    x = layer(x)
  return keras.Model(inputs, x)


def make_trainer(mode):
  return mp.PipelineTrainer(
      model(), keras.optimizers.Adam(1e-2), STRATEGY, num_stages=2,
      global_batch_size=BATCH, replica_devices=GROUPS, num_microbatches=2,
      **MODES[mode])


def batches():
  rng = np.random.default_rng(SEED)
  x = rng.normal(size=(BATCH * 64, FEATURES)).astype(np.float32)
  y = rng.integers(0, CLASSES, size=BATCH * 64).astype(np.int32)
  return iter(tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH))


def executed(fn):
  """(fn()'s result, {op type: how many ran}) from a profile of one call."""
  folder = tempfile.mkdtemp()
  tf.profiler.experimental.start(folder)
  try:
    result = fn()
  finally:
    tf.profiler.experimental.stop()
  space = xplane_pb2.XSpace()
  with open(glob.glob(f"{folder}/**/*.xplane.pb", recursive=True)[0],
            "rb") as f:
    space.ParseFromString(f.read())
  counts = {}
  for plane in space.planes:
    for line in plane.lines:
      for event in line.events:
        name = plane.event_metadata[event.metadata_id].name
        if ":" in name:  # "node:OpType", one per kernel run
          kind = name.rsplit(":", 1)[1]
          counts[kind] = counts.get(kind, 0) + 1
  return result, counts


def moved(trainer):
  """What a sync (and ZeRO-3's load) assigns now: bytes and assign ops."""
  out = {}
  calls = {"sync": trainer.sync_copies}
  if trainer.parameter_sharding is not None:
    calls["load"] = trainer.parameter_sharding.load
  for name, call in calls.items():
    result, counts = executed(call)
    out[name] = {"bytes": None if result is None else int(result),
                 "assigns": counts.get("AssignVariableOp", 0)}
  return out


def copies_differ(trainer):
  """The largest |copy r - copy 0| over what the sync keeps equal: the
  weights the step reads, the slots, the seed generators' counters."""
  worst = 0.0
  pairs = list(trainer._copy_pairs())  # pylint: disable=protected-access
  pairs += [(a[1:], b[1:]) for a, b in trainer._seed_pairs()]  # pylint: disable=protected-access
  for a, b in pairs:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    worst = max(worst, float(np.max(np.abs(a - b))))
  return worst


def run():
  out = {"idle": {}, "set_weights": {}, "slot": {}, "restored": {},
         "weights": {}}
  with tempfile.TemporaryDirectory() as folder:
    for mode in MODES:
      trainer = make_trainer(mode)
      data = batches()
      trainer.train(data, 2)
      checkpoint = tf.train.Checkpoint(
          model=trainer.model,
          optimizer=protocols.checkpointed_optimizer(trainer))
      path = checkpoint.save(f"{folder}/{mode}/ckpt")
      trainer.train(data, 2)
      # Nothing changed copy 0 since the last train.
      out["idle"][mode] = moved(trainer)
      # A user's set_weights between train calls.
      rng = np.random.default_rng(1)
      trainer.model.set_weights([rng.normal(size=w.shape).astype(w.dtype)
                                 for w in trainer.model.get_weights()])
      trainer.train(data, 1)
      out["set_weights"][mode] = copies_differ(trainer)
      # A restore of an earlier checkpoint (what a rollback does).
      checkpoint.restore(path).assert_existing_objects_matched()
      trainer.train(data, 1)
      out["restored"][mode] = copies_differ(trainer)
      out["weights"][mode] = [w.tolist() for w in trainer.model.get_weights()]
      # An assignment to one of copy 0's slots (unsharded: the copies
      # hold theirs whole).
      if mode == "plain":
        slot = trainer.optimizer.variables[-1]
        slot.assign(slot + 0.25)
        trainer.train(data, 1)
        out["slot"][mode] = copies_differ(trainer)
  return out
