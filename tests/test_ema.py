"""The EMA of the weights: once per step, on every replica, checkpointed."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import framework
import framework.core.optimizers  # noqa: F401  (the attribute chain below)
import framework.core.trainer  # noqa: F401  (the attribute chain below)
import framework.data.datasets  # noqa: F401  (the attribute chain below)
import framework.data.inputs  # noqa: F401  (the attribute chain below)
import models
from tests.shared_strategy import mirrored

GLOBAL_BATCH = 32


@pytest.fixture(scope="module")
def data():
  return framework.data.datasets.synthetic(num_train=256, num_test=37, image_shape=(4, 4, 3),
                             seed=1)


def make_trainer(strategy, **kwargs):
  keras.utils.set_random_seed(7)
  with strategy.scope():
    net = models.build_model("mlp", (4, 4, 3), 10, hidden_units=(16,),
                             dropout=False)
    opt = framework.core.optimizers.make_optimizer(framework.OptimizerConfig(
        name="momentum", learning_rate=0.05))
  return framework.Trainer(net, opt, strategy, global_batch_size=GLOBAL_BATCH,
                           **kwargs)


def weights(trainer):
  return [v.numpy() for v in trainer.model.trainable_variables]


def copies(variable):
  return [c.numpy() for c in
          mirrored().experimental_local_results(variable)]


def iterator_for(trainer, data):
  return iter(framework.data.inputs.distribute_train(trainer.strategy, data, GLOBAL_BATCH,
                                         seed=3))


@pytest.mark.parametrize("warmup", [False, True])
def test_ema_equals_hand_computed_average_on_two_replicas(data, warmup):
  strategy = mirrored()
  assert strategy.num_replicas_in_sync == 2
  decay = 0.75
  trainer = make_trainer(strategy, ema_decay=decay, ema_warmup=warmup)
  iterator = iterator_for(trainer, data)
  expected = weights(trainer)
  for n in range(4):
    before = weights(trainer)
    trainer.train(iterator, 1)
    after = weights(trainer)
    assert max(float(np.abs(a - b).max()) for a, b in zip(after, before)) > 0
    d = min(decay, (1 + n) / (10 + n)) if warmup else decay
    expected = [d * e + (1 - d) * w for e, w in zip(expected, after)]
  assert int(trainer.ema.num_updates.numpy()) == 4
  for average, want in zip(trainer.ema.averages, expected):
    got = copies(average)
    assert len(got) == 2
    np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got[0], got[1])  # replicas agree exactly


def test_one_average_per_step_inside_a_loop(data):
  strategy = mirrored()
  stepwise = make_trainer(strategy, ema_decay=0.75)
  iterator = iterator_for(stepwise, data)
  for _ in range(4):
    stepwise.train(iterator, 1)
  looped = make_trainer(strategy, ema_decay=0.75)
  looped.train(iterator_for(looped, data), 4)
  assert int(looped.ema.num_updates.numpy()) == 4
  for a, b in zip(stepwise.ema.averages, looped.ema.averages):
    np.testing.assert_allclose(copies(a)[0], copies(b)[0], rtol=1e-6,
                               atol=1e-7)


def test_evaluation_uses_the_average_and_restores_the_weights(data):
  strategy = mirrored()
  trainer = make_trainer(strategy, ema_decay=0.5)
  trainer.train(iterator_for(trainer, data), 3)
  raw = weights(trainer)
  results = trainer.evaluate(framework.data.inputs.distribute_eval(
      strategy, data.test_x, data.test_y, GLOBAL_BATCH))
  assert [np.array_equal(a, b) for a, b in zip(raw, weights(trainer))] == [
      True] * len(raw)

  def loss_with(values):
    for var, value in zip(trainer.model.trainable_variables, values):
      var.assign(value)
    logits = trainer.model(framework.data.inputs.to_float(data.test_x),
                           training=False)
    return float(tf.reduce_mean(framework.core.trainer.sparse_categorical_loss(
        data.test_y, logits)))

  averaged = [copies(a)[0] for a in trainer.ema.averages]
  assert results["loss"] == pytest.approx(loss_with(averaged), rel=1e-5)
  assert results["loss"] != pytest.approx(loss_with(raw), rel=1e-3)
  loss_with(raw)


def test_average_survives_a_checkpoint(tmp_path, data):
  strategy = mirrored()
  trainer = make_trainer(strategy, ema_decay=0.9)
  trainer.train(iterator_for(trainer, data), 2)
  path = tf.train.Checkpoint(**trainer.ema.checkpoint_items()).save(
      str(tmp_path / "ckpt"))
  fresh = make_trainer(strategy, ema_decay=0.9)
  tf.train.Checkpoint(**fresh.ema.checkpoint_items()).restore(
      path).assert_consumed()
  assert int(fresh.ema.num_updates.numpy()) == 2
  for a, b in zip(trainer.ema.averages, fresh.ema.averages):
    assert copies(b)[0].tolist() == copies(a)[0].tolist()
    assert copies(b)[1].tolist() == copies(a)[0].tolist()


def test_bad_decay_is_rejected():
  with pytest.raises(framework.ConfigError, match="ema_decay=1.0"):
    make_trainer(mirrored(), ema_decay=1.0)


def test_resumed_run_continues_the_same_average(tmp_path):
  # pylint: disable=g-import-not-at-top
  from test_stop_at_accuracy import h5_arrays
  from test_train_script import train
  flags = ["--strategy=mirrored", "--cpu_devices=2", "--steps_per_loop=5",
           "--checkpoint_every=10", "--ema_decay=0.8", "--ema_warmup",
           "--export_saved_model=false"]
  train(tmp_path / "straight", *flags, "--train_steps=20")
  train(tmp_path / "resumed", *flags, "--train_steps=10")
  proc = train(tmp_path / "resumed", *flags, "--train_steps=20")
  assert "Restored checkpoint" in proc.stderr
  for name in ("model.weights.h5", "model.raw.weights.h5"):
    expected = h5_arrays(tmp_path / "straight" / name)
    resumed = h5_arrays(tmp_path / "resumed" / name)
    assert expected.keys() == resumed.keys() and expected
    for key in expected:
      np.testing.assert_array_equal(expected[key], resumed[key])


def test_evaluate_py_reports_what_training_reported(tmp_path):
  # pylint: disable=g-import-not-at-top
  from framework.app import evaluation, experiment
  small = framework.data.datasets.synthetic(num_train=64, num_test=21, seed=2)
  data_dir = str(tmp_path / "cifar")
  framework.data.datasets.write_cifar10(data_dir, small.train_x, small.train_y,
                          small.test_x, small.test_y)
  model_dir = str(tmp_path / "run")
  config = framework.ExperimentConfig(
      model="mlp", dataset="cifar10", data_dir=data_dir, model_dir=model_dir,
      strategy="mirrored", global_batch_size=16, train_steps=6,
      model_options={"hidden_units": (32,)}, export_saved_model=False,
      ema_decay=0.5, eval_tta="flip", label_smoothing=0.2,
      loop=framework.LoopConfig(train_steps=6, steps_per_loop=3,
                                checkpoint_every=3))
  trained = experiment.run(config, strategy=mirrored())
  evaluated = evaluation.Evaluator(
      evaluation.EvalConfig(model_dir=model_dir),
      strategy=mirrored()).evaluate().metrics
  for name in ("loss", "accuracy", "examples"):
    assert evaluated[name] == pytest.approx(trained[name], rel=1e-6)
