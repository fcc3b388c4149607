"""Fused optimizer kernels give Keras's own update, slots and step count."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from framework.core import optimizers
from test_trainer import data, make_trainer, max_diff, train  # pylint: disable=unused-import

OPTIMIZERS = [("sgd", 0.05), ("momentum", 0.05), ("adam", 1e-3),
              ("adamw", 1e-3)]


def slots(optimizer):
  return [v.numpy() for v in optimizer.variables
          if v is not optimizer.iterations]


@pytest.mark.parametrize("optimizer,learning_rate", OPTIMIZERS)
@pytest.mark.parametrize("strategy", ["mirrored", "central_storage"])
def test_fused_update_equals_keras_update_step(data, strategy, optimizer,
                                               learning_rate):
  trainers = [make_trainer(strategy, optimizer=optimizer,
                           learning_rate=learning_rate, fused_updates=fused)
              for fused in (False, True)]
  (keras_weights, _), (fused_weights, _) = [train(t, data)
                                            for t in trainers]
  assert max_diff(keras_weights, fused_weights) < 1e-6
  keras_slots, fused_slots = [slots(t.optimizer) for t in trainers]
  assert len(keras_slots) == len(fused_slots)
  if keras_slots:  # plain SGD has none
    assert max_diff(keras_slots, fused_slots) < 1e-6
  assert [int(t.optimizer.iterations.numpy()) for t in trainers] == [5, 5]
  # The weights moved: the comparison is not between two untouched models.
  assert max_diff(keras_weights, train(make_trainer(
      "one_device", optimizer=optimizer), data, steps=0)[0]) > 1e-4


def test_nesterov_momentum_is_fused_too():
  optimizer = keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True)
  reference = keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True)
  fused = optimizers.fused_update(optimizer)
  var, ref_var = tf.Variable([1.0, -2.0]), tf.Variable([1.0, -2.0])
  optimizer.build([var])
  reference.build([ref_var])
  for grad in ([0.5, 0.25], [-1.0, 2.0], [0.1, 0.1]):
    fused(tf.constant(grad), var, tf.constant(0.1))
    reference.update_step(tf.constant(grad), ref_var, tf.constant(0.1))
  np.testing.assert_allclose(var.numpy(), ref_var.numpy(), rtol=1e-6)


def test_the_step_runs_one_kernel_per_variable():
  trainer = make_trainer("one_device", optimizer="adam", learning_rate=1e-3)
  step = tf.function(lambda batch: trainer.strategy.run(trainer.train_step,
                                                        args=(batch,)))
  graph = step.get_concrete_function((tf.TensorSpec([32, 4, 4, 3]),
                                      tf.TensorSpec([32], tf.int32))).graph
  op_types = [op.type for op in graph.get_operations()]
  assert op_types.count("ResourceApplyAdam") == len(
      trainer.model.trainable_variables)


@pytest.mark.parametrize("optimizer", [
    keras.optimizers.Adam(amsgrad=True), keras.optimizers.RMSprop(),
    type("MyAdam", (keras.optimizers.Adam,), {})()])
def test_no_fused_kernel_falls_back_to_update_step(optimizer):
  assert optimizers.fused_update(optimizer) is None


def test_the_update_follows_the_trainer_s_current_optimizer(data):
  # The distribution check traces a step with a probe SGD swapped in, then
  # restores the trainer's Adam: training afterwards must use Adam's kernel
  # and slots, exactly as a trainer that was never checked.
  from framework.check import distribution_check  # pylint: disable=g-import-not-at-top
  from framework.data import inputs  # pylint: disable=g-import-not-at-top
  plain, checked = [make_trainer("one_device", optimizer="adam",
                                 learning_rate=1e-3) for _ in range(2)]
  batch = next(iter(inputs.train_dataset(data, 32)))
  distribution_check.check_distribution(
      checked, lambda: make_trainer("one_device", optimizer="adam",
                                    learning_rate=1e-3), batch, print_fn=None)
  assert max_diff(train(plain, data)[0], train(checked, data)[0]) == 0.0
