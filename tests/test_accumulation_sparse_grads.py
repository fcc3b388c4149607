"""Gradient accumulation of an embedding's sparse gradient (IndexedSlices),
e.g. the GPT's untied token table: K micro-batches give the whole batch's
update."""

import keras
import numpy as np
import tensorflow as tf

import framework
import framework.core.optimizers  # noqa: F401  (the attribute chain below)


def _train(grad_accum_steps, steps=2, batch=8):
  keras.utils.set_random_seed(3)
  strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
  with strategy.scope():
    tokens = keras.Input((5,), dtype="int32")
    x = keras.layers.Embedding(12, 4)(tokens)
    x = keras.layers.GlobalAveragePooling1D()(x)
    model = keras.Model(tokens, keras.layers.Dense(3)(x))
    optimizer = framework.core.optimizers.make_optimizer(
        framework.OptimizerConfig(name="adam", learning_rate=0.1))
  trainer = framework.Trainer(model, optimizer, strategy,
                              global_batch_size=batch,
                              grad_accum_steps=grad_accum_steps)
  rng = np.random.default_rng(0)
  data = tf.data.Dataset.from_tensor_slices(
      (rng.integers(0, 12, (64, 5)).astype("int32"),
       rng.integers(0, 3, (64,)).astype("int32"))).batch(batch).repeat()
  trainer.train(iter(strategy.experimental_distribute_dataset(data)), steps)
  return [w.numpy() for w in model.trainable_variables]


def test_accumulated_embedding_gradient_equals_the_whole_batch():
  whole = _train(1)
  for a, b in zip(_train(4), whole):
    np.testing.assert_allclose(a, b, atol=1e-5)
