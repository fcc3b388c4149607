"""Guards for the hot path: the train loop traces once per input signature."""

import numpy as np
import tensorflow as tf

import framework
import framework.core.optimizers  # noqa: F401  (the attribute chain below)
import framework.data.datasets  # noqa: F401  (the attribute chain below)
import framework.data.inputs  # noqa: F401  (the attribute chain below)
import models
from tests import shared_strategy


def _mlp_trainer(strategy, global_batch_size=16):
  with strategy.scope():
    model = models.build_model("mlp", (4, 4, 3), 10, hidden_units=(8,))
    optimizer = framework.core.optimizers.make_optimizer(framework.OptimizerConfig())
  return framework.Trainer(model, optimizer, strategy,
                           global_batch_size=global_batch_size)


def test_train_loop_traces_once_over_many_loops():
  strategy = shared_strategy.mirrored()
  data = framework.data.datasets.synthetic(num_train=64, num_test=20, image_shape=(4, 4, 3))
  trainer = _mlp_trainer(strategy)
  iterator = iter(framework.data.inputs.distribute_train(strategy, data, 16))
  # Loops of different lengths, as the controller runs them between events.
  for num_steps in (1, 3, 2, 5, 1, 4, 7, 2):
    metrics = trainer.train(iterator, num_steps)
  assert np.isfinite(float(metrics["loss"]))
  assert int(trainer.global_step.numpy()) == 25
  assert trainer._train_loop.experimental_get_tracing_count() == 1  # pylint: disable=protected-access
  # The loop's first step and its body share one trace of the step.
  assert trainer._loop_step.experimental_get_tracing_count() == 1  # pylint: disable=protected-access
  # A fresh iterator over the same pipeline (a resumed run) reuses the trace.
  trainer.train(iter(framework.data.inputs.distribute_train(strategy, data, 16,
                                                start_step=25)), 3)
  assert trainer._train_loop.experimental_get_tracing_count() == 1  # pylint: disable=protected-access
  # Evaluation: one trace for every pass over the eval set.
  for _ in range(3):
    trainer.evaluate(framework.data.inputs.distribute_eval(strategy, data.test_x,
                                               data.test_y, 16))
  assert trainer._eval_loop.experimental_get_tracing_count() == 1  # pylint: disable=protected-access


def test_graph_flops_match_the_analytic_count():
  from framework.perf import flops  # pylint: disable=g-import-not-at-top
  import keras  # pylint: disable=g-import-not-at-top
  model = keras.Sequential([
      keras.Input((8, 8, 3)),
      keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
      keras.layers.Conv2D(16, 3, padding="valid", activation="relu"),
      keras.layers.Flatten(),
      keras.layers.Dense(10)])
  analytic = flops.analytic_flops_per_example(model)
  conv1, conv2 = 2 * 8 * 8 * 16 * 9 * 3, 2 * 6 * 6 * 16 * 9 * 16
  dense = 2 * 6 * 6 * 16 * 10
  assert analytic["forward"] == conv1 + conv2 + dense
  # Training: forward + weight gradients + input gradients (not layer 1's).
  assert analytic["training"] == 3 * (conv1 + conv2 + dense) - conv1
  counted = flops.training_flops_per_example(model, (8, 8, 3), batch_size=4)
  assert counted["matmul"] == analytic["training"]
  # TF's profiler also counts element-wise ops (and over-counts the gradient
  # of a 'valid' convolution).
  assert counted["all"] > counted["matmul"]


def test_layer_kernel_times_under_mixed_bfloat16():
  from framework.perf import flops  # pylint: disable=g-import-not-at-top
  import keras  # pylint: disable=g-import-not-at-top
  keras.mixed_precision.set_global_policy("mixed_bfloat16")
  try:
    model = keras.Sequential([
        keras.Input((8, 8, 3)),
        keras.layers.Conv2D(4, 3, activation="relu"),
        keras.layers.Flatten(),
        keras.layers.Dense(10, activation="relu")])
  finally:
    keras.mixed_precision.set_global_policy("float32")
  # The layers compute in bfloat16: their inputs and output gradients must
  # too (a float32 output gradient met a bfloat16 ReluGrad before).
  rows = flops.layer_kernel_times(model, batch_size=2, calls=1)
  assert [r["layer"] for r in rows] == [l.name for l in model.layers
                                        if l.trainable_weights]
  assert all(r["ms"] > 0 and r["flops"] > 0 for r in rows)
