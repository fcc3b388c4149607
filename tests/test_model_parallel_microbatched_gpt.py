"""A tensor-split GPT with micro-batches (`--num_microbatches`, GPipe) equals
the unsplit GPT: each micro-batch's embedding-lookup gradient is an
IndexedSlices, and the split's accumulation sums them."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from framework import model_parallel as mp
from models import gpt_parallel
from tests.transformer_split_reference import (BATCH, STRATEGY, flat,
                                               relative, tiny_gpt,
                                               token_batches, unsplit_run)

TOLERANCE = 1e-5
STEPS = 2


def _train(trainer, x, y):
  data = iter(tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH))
  return [float(trainer.train(data, 1)["loss"]) for _ in range(STEPS)]


@pytest.mark.slow
@pytest.mark.parametrize("num_shards, num_stages, tied", [
    (2, 1, True),    # --mesh=model:2 --num_microbatches=2
    (2, 1, False),
    (1, 2, False),   # the GPT's pipeline: one shard per stage
])
def test_micro_batched_split_equals_unsplit(num_shards, num_stages, tied):
  x, y = token_batches(STEPS)
  # The unsplit run, trained once per `tied` (the untied cases share it).
  _, reference_losses, reference_weights = unsplit_run(STEPS, tied)
  split = mp.TensorParallelTrainer(
      tiny_gpt(tied), keras.optimizers.SGD(0.5, momentum=0.9), STRATEGY,
      global_batch_size=BATCH, num_shards=num_shards,
      tensor_stages=num_stages, num_microbatches=2,
      devices=["/CPU:0", "/CPU:1"])
  split_losses = _train(split, x, y)
  assert max(relative(a, b) for a, b in zip(split_losses,
                                            reference_losses)) < TOLERANCE
  weights = relative(flat(split.model.logical_weights()),
                     reference_weights[-1])
  assert weights < TOLERANCE
  moved = relative(flat(split.model.logical_weights()),
                   flat(gpt_parallel.logical_weights(tiny_gpt(tied))))
  assert moved > 1e-2
  assert np.isfinite(split_losses).all()
