"""The tiny GPT, unsplit and tensor-split, trained side by side (not a
test module: the tests run it in-process on 2 devices and in a fresh
process on 4)."""

import keras
import numpy as np
import tensorflow as tf

import framework
from framework import model_parallel as mp
from models import gpt_parallel
from tests.model_parallel_reference import STRATEGY, build

BATCH, LENGTH, VOCAB = 8, 16, 64
OPTIONS = dict(num_layers=2, num_heads=4, model_width=32)


def tiny_gpt(tied=True, num_layers=OPTIONS["num_layers"]):
  return build("gpt", (LENGTH,), VOCAB, tie_embeddings=tied,
               **dict(OPTIONS, num_layers=num_layers))


def token_batches(steps, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.integers(0, VOCAB, size=(BATCH * steps, LENGTH)).astype(np.int32)
  y = rng.integers(0, VOCAB, size=(BATCH * steps, LENGTH)).astype(np.int32)
  return x, y


def relative(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def flat(weights):
  return np.concatenate([np.ravel(w.numpy()) for w in weights])


# (steps, tied, num_layers) -> the unsplit run: every split of a process
# compares against the same one, trained once (op determinism: each run
# would give the same numbers).
_UNSPLIT = {}


def unsplit_run(steps, tied=True, num_layers=OPTIONS["num_layers"]):
  """(forward on the first batch, loss per step, flat logical weights after
  each step) of the unsplit GPT on token_batches(steps), once per
  process."""
  key = (steps, tied, num_layers)
  if key not in _UNSPLIT:
    x, y = token_batches(steps)
    reference = framework.Trainer(
        tiny_gpt(tied, num_layers), keras.optimizers.SGD(0.5, momentum=0.9),
        STRATEGY, global_batch_size=BATCH)
    forward = reference.model(x[:BATCH]).numpy()
    iterator = iter(tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH))
    losses, weights = [], []
    for _ in range(steps):
      losses.append(float(reference.train(iterator, 1)["loss"]))
      weights.append(flat(gpt_parallel.logical_weights(reference.model)))
    _UNSPLIT[key] = forward, losses, weights
  return _UNSPLIT[key]


def compare(steps, num_shards, replica_devices=None, tied=True,
            num_stages=1, num_layers=OPTIONS["num_layers"]):
  """Relative differences (forward, per-step loss, weights after each step)
  of the split GPT against the unsplit one, on the same batches."""
  x, y = token_batches(steps)
  ref_forward, ref_losses, ref_weights = unsplit_run(steps, tied,
                                                     num_layers)
  split = mp.TensorParallelTrainer(
      tiny_gpt(tied, num_layers), keras.optimizers.SGD(0.5, momentum=0.9),
      STRATEGY, global_batch_size=BATCH, num_shards=num_shards,
      devices=[f"/CPU:{i}" for i in range(num_shards * num_stages)],
      replica_devices=replica_devices, tensor_stages=num_stages)
  forward = relative(np.concatenate(
      [t.numpy() for t in split.model(x[:BATCH])], -1), ref_forward)
  split_it = iter(tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH))
  out = {"forward": forward, "loss": [], "weights": []}
  for step in range(steps):
    out["loss"].append(relative(float(split.train(split_it, 1)["loss"]),
                                ref_losses[step]))
    # Over all weights at once: the key biases have an exactly zero true
    # gradient (softmax ignores a shift shared by all keys), so they stay
    # at their zero start plus float noise and have no scale of their own.
    out["weights"].append(relative(flat(split.model.logical_weights()),
                                   ref_weights[step]))
  start = gpt_parallel.logical_weights(tiny_gpt(tied, num_layers))
  out["moved"] = relative(split.model.logical_weights()[0].numpy(),
                          start[0].numpy())
  out["devices"] = sorted({mp.variable_device(v)
                           for v in split.model.trainable_variables})
  out["trainer"] = split
  return out
