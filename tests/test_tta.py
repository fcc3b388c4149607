"""Flip test-time augmentation: the mean of the two views' logits, exact
under MirroredStrategy with a partial last batch."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import framework
import framework.core.trainer  # noqa: F401  (the attribute chain below)
import framework.data.datasets  # noqa: F401  (the attribute chain below)
import framework.data.inputs  # noqa: F401  (the attribute chain below)
import framework.tasks.segmentation  # noqa: F401  (the attribute chain below)
import models
from framework.core import evaluation
from framework.data.inputs import to_float
from tests.shared_strategy import mirrored

GLOBAL_BATCH = 16  # 37 test examples: a last batch of 5, split 3 + 2


def build(strategy):
  keras.utils.set_random_seed(5)
  with strategy.scope():
    # A conv net, so that a mirrored image gives other logits.
    net = models.build_model("cifar_cnn", (8, 8, 3), 10, dropout=False)
  return net


@pytest.mark.parametrize("trainer_cls", [framework.Trainer,
                                         framework.tasks.segmentation.ConfusionTrainer])
def test_flip_tta_equals_the_mean_of_both_views(trainer_cls):
  data = framework.data.datasets.synthetic(num_train=64, num_test=37, image_shape=(8, 8, 3),
                             seed=2)
  strategy = mirrored()
  net = build(strategy)
  with strategy.scope():
    opt = keras.optimizers.SGD()
  trainer = trainer_cls(net, opt, strategy, global_batch_size=GLOBAL_BATCH,
                        eval_tta="flip")
  results = trainer.evaluate(framework.data.inputs.distribute_eval(
      strategy, data.test_x, data.test_y, GLOBAL_BATCH))
  images = to_float(tf.constant(data.test_x))
  plain = net(images, training=False).numpy()
  flipped = net(images[:, :, ::-1], training=False).numpy()
  assert np.abs(plain - flipped).max() > 1e-4  # the views differ
  mean = 0.5 * (plain + flipped)
  labels = data.test_y
  assert results["examples"] == 37
  assert results["accuracy"] == pytest.approx(
      float(np.mean(mean.argmax(-1) == labels)), abs=1e-9)
  assert results["loss"] == pytest.approx(float(np.mean(
      framework.core.trainer.sparse_categorical_loss(labels, mean))), rel=1e-5)
  plain_loss = float(np.mean(framework.core.trainer.sparse_categorical_loss(labels, plain)))
  assert results["loss"] != pytest.approx(plain_loss, rel=1e-4)


def test_per_pixel_outputs_are_mirrored_back():
  keras.utils.set_random_seed(3)
  net = keras.Sequential([keras.Input((4, 6, 3)),
                          keras.layers.Conv2D(5, 3, padding="same")])
  images = tf.random.stateless_normal([2, 4, 6, 3], seed=[1, 2])
  expected = 0.5 * (net(images) + tf.reverse(
      net(tf.reverse(images, [2])), [2]))
  np.testing.assert_allclose(evaluation.flip_logits(net, images).numpy(),
                             expected.numpy(), rtol=1e-5, atol=1e-6)


def test_unknown_mode_is_rejected():
  with pytest.raises(framework.ConfigError, match="eval_tta"):
    evaluation.check_tta("rotate")


def test_model_parallel_runs_reject_ema_and_tta():
  from framework.model_parallel import ModelParallelConfig  # pylint: disable=g-import-not-at-top
  for extra in ({"eval_tta": "flip"}, {"ema_decay": 0.9}):
    with pytest.raises(framework.ConfigError, match="model_parallel=pipeline"):
      framework.ExperimentConfig(
          train_steps=1, model_parallel=ModelParallelConfig(mode="pipeline"),
          **extra)
