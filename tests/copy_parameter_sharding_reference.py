"""ZeRO-3 on a mesh's data axis (`data:2,pipeline:2`) against ZeRO-2 and
unsharded on the same mesh, with gradient accumulation, clipping, Dropout
and BatchNorm (not a test module: the tests run it in a fresh process with
4 logical CPU devices).
"""

import tempfile

import keras
import numpy as np
import tensorflow as tf

from framework import model_parallel as mp
from framework.core import protocols
from framework.core.trainer import Trainer
from framework.model_parallel.copies import tf_variable
from tests.transformer_split_reference import flat, relative

STRATEGY = tf.distribute.get_strategy()  # one replica: the mesh's own copies
GROUPS = [["/CPU:0", "/CPU:1"], ["/CPU:2", "/CPU:3"]]
BATCH, FEATURES, CLASSES = 16, 9, 5
SEED = 6311
ACCUM, CLIP, MICRO = 2, 0.05, 2  # the clip acts: the norms are above it
MODES = {"plain": {},
         "zero2": dict(shard_optimizer_state=True, shard_gradients=True),
         "zero3": dict(shard_optimizer_state=True, shard_gradients=True,
                       shard_parameters=True)}
OPTIMIZERS = {"adamw": lambda: keras.optimizers.AdamW(1e-2, weight_decay=0.1),
              "momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9)}


def model(kind="functional"):
  """Dense, BatchNorm, Dropout, Dense, Dense: the same weights per call."""
  keras.utils.set_random_seed(SEED)
  layers = [keras.layers.Dense(13, activation="relu", name="d1"),
            keras.layers.BatchNormalization(name="bn"),
            keras.layers.Dropout(0.3, seed=SEED, name="drop"),
            keras.layers.Dense(11, activation="relu", name="d2"),
            keras.layers.Dense(CLASSES, name="logits")]
  if kind == "sequential":
    return keras.Sequential([keras.Input((FEATURES,))] + layers)
  x = inputs = keras.Input((FEATURES,))
  for layer in layers:
    x = layer(x)
  return keras.Model(inputs, x)


def make_trainer(mode, optimizer="adamw", kind="functional"):
  return mp.PipelineTrainer(
      model(kind), OPTIMIZERS[optimizer](), STRATEGY, num_stages=2,
      global_batch_size=BATCH, replica_devices=GROUPS,
      grad_accum_steps=ACCUM, clip_norm=CLIP, num_microbatches=MICRO,
      **MODES[mode])


def dataset(steps):
  rng = np.random.default_rng(SEED)
  x = rng.normal(size=(BATCH * steps, FEATURES)).astype(np.float32)
  y = rng.integers(0, CLASSES, size=BATCH * steps).astype(np.int32)
  return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)


def checkpoint(trainer):
  return tf.train.Checkpoint(
      model=trainer.model,
      optimizer=protocols.checkpointed_optimizer(trainer))


def saved(path):
  reader = tf.train.load_checkpoint(path)
  return {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map()
          if k.startswith(("optimizer/", "model/"))}


def op_counts(trainer):
  """{what: count} of the traced step (traced once, not run)."""
  step = tf.function(trainer.train_step)
  graph = step.get_concrete_function(
      (tf.TensorSpec((BATCH, FEATURES), tf.float32),
       tf.TensorSpec((BATCH,), tf.int32))).graph
  ops = graph.get_operations()
  return {"gathers": sum(op.type == "ConcatV2" and "gather_weights/"
                         in op.name for op in ops), **joins(graph)}


def _in_backward(op):
  """Whether `op` belongs to a backward pass: a tape's gradient op, or a
  placed block's second run (`parallel_layers.on_device`)."""
  return "gradient_tape/" in op.name or "block_backward" in op.name


def _weight_users(join):
  """The ops that read a joined weight (past its reshape, slice, cast)."""
  users, frontier = [], [join]
  while frontier:
    for tensor in frontier.pop().outputs:
      for op in tensor.consumers():
        if op.type in ("StridedSlice", "Reshape", "Identity", "Cast"):
          frontier.append(op)
        else:
          users.append(op)
  return users


def joins(graph):
  """ZeRO-3's weight joins in a traced step: how many in the forward and
  in the backward pass; `groups`, the distinct sets of tensors the forward
  joins wait for (one per block that reads weights: one per stage if a
  stage joined all its weights at once); `kept`, forward joins whose
  weight a backward op reads (kept alive until then)."""
  ops = [op for op in graph.get_operations()
         if op.type == "ConcatV2" and "gather_weights/" in op.name]
  forward = [op for op in ops if not _in_backward(op)]
  groups = {frozenset(c.name for t in op.inputs for c in t.op.control_inputs)
            for op in forward}
  return {"forward": len(forward), "backward": len(ops) - len(forward),
          "groups": len(groups),
          "kept": sum(any(_in_backward(user) for user in _weight_users(op))
                      for op in forward)}


def step_variables_by_device(trainer):
  """{device: [elements of each variable the traced step reads]}."""
  step = tf.function(trainer.train_step)
  graph = step.get_concrete_function(
      (tf.TensorSpec((BATCH, FEATURES), tf.float32),
       tf.TensorSpec((BATCH,), tf.int32))).graph
  read = {id(t) for t, _ in graph.captures}
  out = {}
  candidates = [v for m in [trainer.model] + [c[1] for c in trainer.copies]
                for v in m.trainable_variables]
  if trainer.copy_sharding is not None:
    candidates += [s for shards in trainer.copy_sharding.shards
                   for s in shards]
  for v in candidates:
    handle = v.value.handle if isinstance(v, keras.Variable) else v.handle
    if id(handle) in read:
      device = v.value.device.split("device:")[-1]
      out.setdefault(device, []).append(int(np.prod(v.shape)))
  return out


def run(steps=2):
  out = {}
  trained = {}
  with tempfile.TemporaryDirectory() as folder:
    for optimizer in OPTIMIZERS:
      for mode in MODES:
        trainer = make_trainer(mode, optimizer)
        out.setdefault("kinds", {})[mode] = type(trainer.updater).__name__
        if optimizer == "adamw":
          out.setdefault("ops", {})[mode] = op_counts(trainer)
          out.setdefault("read", {})[mode] = step_variables_by_device(trainer)
        start = flat(trainer.model.trainable_weights)
        iterator = iter(dataset(2 * steps))
        metrics = trainer.train(iterator, steps)
        out.setdefault("grad_norm", {})[f"{optimizer}/{mode}"] = float(
            metrics["grad_norm"])
        path = checkpoint(trainer).save(f"{folder}/{optimizer}/{mode}/ckpt")
        trained[optimizer, mode] = (trainer, iterator, path, start)
      plain = saved(trained[optimizer, "plain"][2])
      out["moved"] = relative(flat(trained[optimizer, "plain"][0]
                                   .model.trainable_weights), start)
      for mode in ("zero2", "zero3"):
        other = saved(trained[optimizer, mode][2])
        out[f"{optimizer}/{mode}"] = {
            "keys": sorted(other) == sorted(plain),
            # [largest |difference|, largest |value|] of each saved tensor.
            "saved": {k: [float(np.max(np.abs(other[k] - plain[k]))),
                          float(np.max(np.abs(plain[k])))]
                      for k in plain if other[k].dtype.kind == "f"},
            "copy_elements": sum(
                int(tf.size(tf_variable(v).read_value()))
                for c in trained[optimizer, mode][0].copies
                for v in c[1].trainable_variables),
            "steps": int(trained[optimizer, mode][0]
                         .optimizer.iterations.numpy())}
      zero2, zero3 = (saved(trained[optimizer, m][2])
                      for m in ("zero2", "zero3"))
      out[f"{optimizer}/zero3_vs_zero2"] = max(
          float(np.max(np.abs(zero3[k] - zero2[k]))) for k in zero2
          if zero2[k].dtype.kind == "f")
    # Resumes, each against the same run resumed from the unsharded
    # mesh's checkpoint: ZeRO-3's checkpoint on the unsharded mesh and on
    # one device unsplit, the unsharded mesh's on ZeRO-3.
    paths = {mode: trained["adamw", mode][2] for mode in ("plain", "zero3")}

    def rest():
      it = iter(dataset(2 * steps))
      for _ in range(steps):
        next(it)
      return it

    def resumed(mode, path):
      trainer = make_trainer(mode)
      checkpoint(trainer).restore(path).assert_existing_objects_matched()
      trainer.train(rest(), steps)
      return flat(trainer.model.trainable_weights)

    def unsplit(path):
      trainer = Trainer(model(), OPTIMIZERS["adamw"](), STRATEGY,
                        global_batch_size=BATCH, grad_accum_steps=ACCUM,
                        clip_norm=CLIP)
      trainer.optimizer.build(trainer.model.trainable_variables)
      tf.train.Checkpoint(model=trainer.model, optimizer=trainer.optimizer
                          ).restore(path).assert_existing_objects_matched()
      trainer.train(rest(), steps)
      return flat(trainer.model.trainable_weights)

    reference = resumed("plain", paths["plain"])
    out["resumed_moved"] = relative(reference, flat(
        trained["adamw", "plain"][0].model.trainable_weights))
    out["zero3_to_plain"] = relative(resumed("plain", paths["zero3"]),
                                     reference)
    out["plain_to_zero3"] = relative(resumed("zero3", paths["plain"]),
                                     reference)
    out["zero3_to_unsplit"] = relative(unsplit(paths["zero3"]),
                                       unsplit(paths["plain"]))
  # The Keras-graph stages above; a Sequential model's `Stage`s here.
  seq = {}
  for mode in ("zero2", "zero3"):
    trainer = make_trainer(mode, kind="sequential")
    start = flat(trainer.model.trainable_weights)
    trainer.train(iter(dataset(steps)), steps)
    seq[mode] = flat(trainer.model.trainable_weights)
  out["sequential_zero3_vs_zero2"] = relative(seq["zero3"], seq["zero2"])
  out["sequential_moved"] = relative(seq["zero3"], start)
  return out
