"""ZeRO-3 on a tensor split's data axis: the GPT (a size and seed of its
own) on `data:2,model:2` (2 copies of a 2-way tensor split; Adam) and on
`data:2,pipeline:2` (2 copies of its blocks cut into 2 stages, the tied
token table read by the last stage's head; AdamW), against ZeRO-2 and
unsharded on the same mesh and the unsplit model on one device, with gradient
accumulation and clipping (not a test module: the tests run it in a fresh
process with 4 logical CPU devices).
"""

import tempfile

import keras
import numpy as np
import tensorflow as tf

from framework import model_parallel as mp
from framework.core import protocols
from framework.core.trainer import Trainer
from framework.model_parallel.copies import tf_variable
from models import gpt_parallel
from tests.copy_parameter_sharding_reference import joins
from tests.model_parallel_reference import build
from tests.transformer_split_reference import flat, relative

STRATEGY = tf.distribute.get_strategy()  # one replica: the mesh's own copies
GROUPS = [["/CPU:0", "/CPU:1"], ["/CPU:2", "/CPU:3"]]
BATCH, LENGTH, VOCAB = 8, 10, 36
SEED = 6331
ACCUM, CLIP = 2, 0.05  # the clip acts: the norms here are above it
MODES = {"plain": {},
         "zero2": dict(shard_optimizer_state=True, shard_gradients=True),
         "zero3": dict(shard_optimizer_state=True, shard_gradients=True,
                       shard_parameters=True)}
OPTIMIZERS = {"adam": lambda: keras.optimizers.Adam(1e-2),
              "adamw": lambda: keras.optimizers.AdamW(1e-2, weight_decay=0.1)}
# (mesh, optimizer, modes): ZeRO-2 beside ZeRO-3 where they are compared.
# (SGD with momentum: tests/test_parameter_sharding_mesh.py's pipeline;
# the update is the same kind for every split.)
CASES = [("data:2,model:2", "adam", ("plain", "zero2", "zero3")),
         ("data:2,pipeline:2", "adamw", ("plain", "zero3"))]


def model():
  return build("gpt", (LENGTH,), VOCAB, seed=SEED, num_layers=2,
               num_heads=2, model_width=12)


def make_trainer(mesh, mode, optimizer="adam"):
  split = (dict(num_shards=2) if mesh == "data:2,model:2"
           else dict(num_shards=1, tensor_stages=2))
  return mp.TensorParallelTrainer(
      model(), OPTIMIZERS[optimizer](), STRATEGY, replica_devices=GROUPS,
      global_batch_size=BATCH, grad_accum_steps=ACCUM, clip_norm=CLIP,
      **split, **MODES[mode])


def dataset(steps):
  rng = np.random.default_rng(SEED)
  x = rng.integers(0, VOCAB, size=(BATCH * steps, LENGTH)).astype(np.int32)
  y = rng.integers(0, VOCAB, size=(BATCH * steps, LENGTH)).astype(np.int32)
  return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)


def rest(steps):
  """The batches after the first `steps`."""
  iterator = iter(dataset(2 * steps))
  for _ in range(steps):
    next(iterator)
  return iterator


def weights(trainer):
  return flat(trainer.model.logical_weights())


def checkpoint(trainer):
  return tf.train.Checkpoint(
      model=trainer.model,
      optimizer=protocols.checkpointed_optimizer(trainer))


def saved(path):
  reader = tf.train.load_checkpoint(path)
  return {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map()
          if k.startswith(("optimizer/", "model/"))}


def traced_step(trainer):
  step = tf.function(trainer.train_step)
  spec = tf.TensorSpec((BATCH, LENGTH), tf.int32)
  return step.get_concrete_function((spec, spec)).graph


def step_reads(trainer, graph):
  """{device: [elements of each variable the traced step reads]}: the
  model's variables of every copy and, sharded, the copies' shards."""
  read = {id(t) for t, _ in graph.captures}
  candidates = [v for m in [trainer.model] + [c[1] for c in trainer.copies]
                for v in m.trainable_variables]
  if trainer.copy_sharding is not None:
    candidates += [s for shards in trainer.copy_sharding.shards
                   for s in shards]
  out = {}
  for v in candidates:
    handle = v.value.handle if isinstance(v, keras.Variable) else v.handle
    if id(handle) in read:
      device = v.value.device.split("device:")[-1]
      out.setdefault(device, []).append(int(np.prod(v.shape)))
  return out


def copy_elements(trainer):
  """Elements the trainable variables of copies 1..R-1 hold (allocated)."""
  return sum(int(tf.size(tf_variable(v).read_value())) for c in trainer.copies
             for v in c[1].trainable_variables)


def whole_elements(trainer):
  """{device: [elements of each model variable of every copy there]}."""
  out = {}
  for m in [trainer.model] + [c[1] for c in trainer.copies]:
    for v in m.trainable_variables:
      device = v.value.device.split("device:")[-1]
      out.setdefault(device, []).append(int(np.prod(v.shape)))
  return out


def unsplit(path, optimizer, steps):
  """The unsplit GPT on one device, restored from `path`, `steps` more."""
  trainer = Trainer(model(), OPTIMIZERS[optimizer](), STRATEGY,
                    global_batch_size=BATCH, grad_accum_steps=ACCUM,
                    clip_norm=CLIP)
  trainer.optimizer.build(trainer.model.trainable_variables)
  tf.train.Checkpoint(model=trainer.model, optimizer=trainer.optimizer
                      ).restore(path).assert_existing_objects_matched()
  trainer.train(rest(steps), steps)
  return flat(gpt_parallel.logical_weights(trainer.model))


def run(steps=2):
  out = {}
  with tempfile.TemporaryDirectory() as folder:
    for mesh, optimizer, modes in CASES:
      case = out[f"{mesh}/{optimizer}"] = {}
      trained = {}
      for mode in modes:
        trainer = make_trainer(mesh, mode, optimizer)
        case.setdefault("kinds", {})[mode] = type(trainer.updater).__name__
        if mode == "zero3":
          graph = traced_step(trainer)
          case.setdefault("read", {})[mode] = step_reads(trainer, graph)
          case.setdefault("gathers", {})[mode] = sum(
              op.type == "ConcatV2" and "gather_weights/" in op.name
              for op in graph.get_operations())
          case.setdefault("joins", {})[mode] = joins(graph)
        start = weights(trainer)
        metrics = trainer.train(iter(dataset(2 * steps)), steps)
        case.setdefault("grad_norm", {})[mode] = float(metrics["grad_norm"])
        path = checkpoint(trainer).save(f"{folder}/{mesh}/{optimizer}/{mode}")
        trained[mode] = (trainer, path)
      case["whole"] = whole_elements(trained["plain"][0])
      case["variables"] = len(trained["plain"][0].model.trainable_variables)
      case["moved"] = relative(weights(trained["plain"][0]), start)
      plain = saved(trained["plain"][1])
      for mode in modes[1:]:
        other = saved(trained[mode][1])
        case[mode] = {
            "keys": sorted(other) == sorted(plain),
            # [largest |difference|, largest |value|] of each saved tensor.
            "saved": {k: [float(np.max(np.abs(other[k] - plain[k]))),
                          float(np.max(np.abs(plain[k])))]
                      for k in plain if other[k].dtype.kind == "f"},
            "copy_elements": copy_elements(trained[mode][0]),
            "steps": int(trained[mode][0].optimizer.iterations.numpy())}
        if mode != "zero3":  # ZeRO-3's copies 1..R-1 hold no whole weights
          case[mode]["copies"] = relative(
              flat(trained[mode][0].copies[0][1].logical_weights()),
              weights(trained[mode][0]))
      if "zero2" in modes:
        zero2, zero3 = saved(trained["zero2"][1]), saved(trained["zero3"][1])
        case["zero3_vs_zero2"] = max(
            float(np.max(np.abs(zero3[k] - zero2[k]))) for k in zero2
            if zero2[k].dtype.kind == "f")
      if mesh != "data:2,model:2" or optimizer != "adam":
        continue
      # Resumes, each against the unsharded mesh's checkpoint resumed the
      # same way: ZeRO-3's on the unsharded mesh and on one device
      # unsplit, the unsharded mesh's with ZeRO-3.

      def resumed(mode, path):
        trainer = make_trainer(mesh, mode, optimizer)
        checkpoint(trainer).restore(path).assert_existing_objects_matched()
        trainer.train(rest(steps), steps)
        return weights(trainer)

      reference = resumed("plain", trained["plain"][1])
      out["resumed_moved"] = relative(reference,
                                      weights(trained["plain"][0]))
      out["zero3_to_plain"] = relative(
          resumed("plain", trained["zero3"][1]), reference)
      out["plain_to_zero3"] = relative(
          resumed("zero3", trained["plain"][1]), reference)
      unsplit_plain = unsplit(trained["plain"][1], optimizer, steps)
      out["zero3_to_unsplit"] = relative(
          unsplit(trained["zero3"][1], optimizer, steps), unsplit_plain)
      out["unsplit_vs_mesh"] = relative(unsplit_plain, reference)
  return out
