"""ZeRO-3 on a mesh's data axis with Keras graphs beyond a chain of
layers: a graph whose nodes include plain ops without weights (the
`not_equal` an Embedding's `mask_zero` adds) trains as the unsharded mesh
does.
"""

import pytest

from tests import helpers

_CODE = """
import json
import framework
framework.configure_cpu_devices(4)
import keras
import numpy as np
import tensorflow as tf
from framework import model_parallel as mp

def model():
  keras.utils.set_random_seed(5)
  inputs = keras.Input((6,), dtype="int32")
  x = keras.layers.Embedding(10, 8, mask_zero=True)(inputs)
  x = keras.layers.Dense(8, activation="relu")(x)
  x = keras.layers.GlobalAveragePooling1D()(x)  # reads the mask
  x = keras.layers.Dense(8, activation="relu")(x)
  return keras.Model(inputs, keras.layers.Dense(3)(x))

rng = np.random.default_rng(5)
x = rng.integers(0, 10, size=(16, 6)).astype(np.int32)
x[:, 3:] = 0
y = (x[:, 0] % 3).astype(np.int32)
weights = {}
for name, shard in (("plain", False), ("zero3", True)):
  trainer = mp.PipelineTrainer(
      model(), keras.optimizers.Adam(1e-2), tf.distribute.get_strategy(),
      num_stages=2, global_batch_size=16,
      replica_devices=[["/CPU:0", "/CPU:1"], ["/CPU:2", "/CPU:3"]],
      shard_optimizer_state=shard, shard_gradients=shard,
      shard_parameters=shard)
  trainer.train(iter(tf.data.Dataset.from_tensors((x, y)).repeat()), 2)
  weights[name] = [np.asarray(w) for w in trainer.model.weights]
print("RESULT " + json.dumps(max(
    float(np.max(np.abs(a - b))) for a, b in zip(*weights.values()))))
"""


@pytest.mark.slow
def test_a_masked_embeddings_graph_trains_as_unsharded():
  assert helpers.run_result(_CODE, timeout=600) < 1e-5
