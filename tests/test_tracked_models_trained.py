"""The default step trains every tracked model the loss reaches: a VAE
ported from keras-io (the encoder the run's model, the decoder tracked, one
optimizer) trains both as a plain Keras GradientTape loop over both models'
weights does, on one device and on mirrored; a frozen teacher and a model
tracked with an optimizer of its own stay as they are; a tracked model the
loss does not reach is one line at the first step."""

import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import framework
import helpers
from shared_strategy import mirrored

GLOBAL_BATCH = 8
STEPS = 4


def _dataset():
  rng = np.random.default_rng(0)
  features = rng.normal(size=(GLOBAL_BATCH * STEPS, 6)).astype(np.float32)
  labels = np.zeros([GLOBAL_BATCH * STEPS], np.int32)
  return tf.data.Dataset.from_tensor_slices((features, labels)).batch(
      GLOBAL_BATCH, drop_remainder=True)


def _models(strategy):
  """(encoder, decoder, teacher, Adam), the same weights at every call."""
  keras.utils.set_random_seed(3)
  with strategy.scope():
    encoder = keras.Sequential([keras.Input((6,)),
                                keras.layers.Dense(5, activation="tanh"),
                                keras.layers.Dense(4)])
    decoder = keras.Sequential([keras.Input((2,)),
                                keras.layers.Dense(5, activation="tanh"),
                                keras.layers.Dense(6)])
    teacher = keras.Sequential([keras.Input((6,)), keras.layers.Dense(6)])
    optimizer = keras.optimizers.Adam(0.01)
  teacher.trainable = False
  return encoder, decoder, teacher, optimizer


def vae_loss(encoder, decoder, teacher, features):
  """keras-io's VAE loss, per example: reconstruction (of a target the
  frozen teacher shifts) + KL; the latent is the mean (no noise)."""
  stats = encoder(features, training=True)
  mean, log_var = stats[:, :2], stats[:, 2:]
  reconstruction = decoder(mean, training=True)
  target = features + 0.1 * teacher(features, training=False)
  squared = tf.reduce_sum(tf.square(target - reconstruction), axis=-1)
  kl = -0.5 * tf.reduce_sum(
      1 + log_var - tf.square(mean) - tf.exp(log_var), axis=-1)
  return squared + kl


class VAETrainer(framework.Trainer):
  """The guide's form: the decoder (and a frozen teacher) tracked."""

  def __init__(self, model, optimizer, strategy, *, decoder, teacher,
               **kwargs):
    super().__init__(model, optimizer, strategy, **kwargs)
    self.decoder, self.teacher = decoder, teacher
    self.track(decoder=self.decoder, teacher=self.teacher)

  def compute_loss(self, batch):
    features, _ = batch
    return vae_loss(self.model, self.decoder, self.teacher, features), {}


def _weights(*models):
  return [[w.numpy() for w in m.weights] for m in models]


def _run(strategy, **kwargs):
  """(encoder, decoder, teacher) weights before and after STEPS steps."""
  encoder, decoder, teacher, optimizer = _models(strategy)
  trainer = VAETrainer(encoder, optimizer, strategy, decoder=decoder,
                       teacher=teacher, global_batch_size=GLOBAL_BATCH,
                       fused_updates=False, **kwargs)
  before = _weights(encoder, decoder, teacher)
  iterator = iter(strategy.experimental_distribute_dataset(_dataset()))
  trainer.train(iterator, STEPS)
  after = _weights(encoder, decoder, teacher)
  # Adam's two slots for each weight of the encoder and the decoder, none
  # for the frozen teacher.
  assert len(optimizer.variables) == 2 + 2 * (4 + 4)
  for model in (0, 1):  # every weight of the encoder and decoder trained
    assert all(not np.array_equal(a, b)
               for a, b in zip(before[model], after[model]))
  return before, after


def _reference():
  """The plain Keras loop: one GradientTape over both models' weights."""
  encoder, decoder, teacher, optimizer = _models(tf.distribute.get_strategy())
  variables = encoder.trainable_variables + decoder.trainable_variables
  for features, _ in _dataset():
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(vae_loss(encoder, decoder, teacher, features))
    optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
  return _weights(encoder, decoder, teacher)


def _assert_close(actual, expected, atol):
  for a_model, e_model in zip(actual, expected):
    for a, e in zip(a_model, e_model):
      np.testing.assert_allclose(a, e, rtol=0, atol=atol)


@pytest.fixture(scope="module")
def one_device():
  return _run(framework.make_strategy("default"))


def test_the_tracked_decoder_trains_as_a_keras_loop_over_both(one_device):
  _, after = one_device
  _assert_close(after, _reference(), atol=1e-6)


def test_a_frozen_teacher_is_unchanged_while_the_decoder_trains(one_device):
  before, after = one_device
  for a, b in zip(before[2], after[2]):
    np.testing.assert_array_equal(a, b)


def test_mirrored_trains_what_one_device_trains(one_device):
  _, after = _run(mirrored())
  _assert_close(after, one_device[1], atol=1e-5)


def test_grad_accumulation_trains_the_tracked_decoder_alike(one_device):
  _, after = _run(framework.make_strategy("default"), grad_accum_steps=2)
  _assert_close(after, one_device[1], atol=1e-5)


class Unreached(framework.Trainer):
  """Tracks a trainable model that its loss never uses."""

  def __init__(self, model, optimizer, strategy, *, decoder, teacher,
               **kwargs):
    super().__init__(model, optimizer, strategy, **kwargs)
    self.decoder = decoder
    self.track(decoder=self.decoder)


def test_a_tracked_model_the_loss_does_not_reach_is_one_line():
  strategy = framework.make_strategy("default")
  encoder, decoder, teacher, optimizer = _models(strategy)
  trainer = Unreached(encoder, optimizer, strategy, decoder=decoder,
                      teacher=teacher, global_batch_size=GLOBAL_BATCH)
  iterator = iter(strategy.experimental_distribute_dataset(_dataset()))
  with pytest.raises(framework.ConfigError) as e:
    trainer.train(iterator, 1)
  message = str(e.value)
  assert "\n" not in message
  assert message.startswith(
      "Unreached.track(decoder=...): the loss reaches none of its 4 "
      "trainable weights, which the default train_step trains with the "
      "run's optimizer; ")
  assert "decoder.trainable = False" in message
  assert int(optimizer.iterations.numpy()) == 0


class OwnOptimizer(VAETrainer):
  """The decoder tracked with an optimizer of its own beside it."""

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    with self.strategy.scope():
      self.decoder_optimizer = keras.optimizers.Adam(0.01)
      self.decoder_optimizer.build(self.decoder.trainable_variables)
    self.track(decoder_optimizer=self.decoder_optimizer)


def test_a_model_with_its_own_tracked_optimizer_is_left_to_it(caplog):
  strategy = framework.make_strategy("default")
  encoder, decoder, teacher, optimizer = _models(strategy)
  with caplog.at_level("WARNING"):
    trainer = OwnOptimizer(encoder, optimizer, strategy, decoder=decoder,
                           teacher=teacher, global_batch_size=GLOBAL_BATCH)
  # Said, not silent: nothing in the default step applies that optimizer.
  assert any("OwnOptimizer.track(decoder=...)" in r.getMessage()
             and "does not apply" in r.getMessage() for r in caplog.records)
  assert [id(v) for v in trainer.trainable_variables] == [
      id(v) for v in encoder.trainable_variables]
  assert len(optimizer.variables) == 2 + 2 * len(encoder.trainable_variables)


# The VAE as an app (train.py's flags): the run's model (mlp, 10 logits) is
# the encoder of a 5-d latent, the tracked decoder reconstructs 8 means of
# the image.
_VAE_APP = """
from distloop_cli import cli
cli.quiet_startup()
cli.import_tensorflow_quietly()
import keras
import tensorflow as tf
import framework
from distloop_cli import train


class VAE(framework.Trainer):

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    with self.strategy.scope():
      self.decoder = keras.Sequential([keras.Input((5,)),
                                       keras.layers.Dense(8)])
    self.track(decoder=self.decoder)

  def compute_loss(self, batch):
    images, _ = batch
    images = tf.cast(images, tf.float32)
    target = tf.reduce_mean(tf.reshape(images, [tf.shape(images)[0], 8, -1]),
                            axis=-1)
    stats = tf.cast(self.model(images, training=True), tf.float32)
    mean, log_var = stats[:, :5], stats[:, 5:]
    squared = tf.reduce_sum(tf.square(target - self.decoder(mean)), axis=-1)
    kl = -0.5 * tf.reduce_sum(
        1 + log_var - tf.square(mean) - tf.exp(log_var), axis=-1)
    return squared + kl, {}


if __name__ == "__main__":
  cli.run_app(lambda argv: train.run_main(trainer_cls=VAE))
"""


def _checkpoint(model_dir):
  path = tf.train.latest_checkpoint(str(model_dir))
  return {name: tf.train.load_variable(path, name)
          for name, _ in tf.train.list_variables(path)
          # How many saves the folder has seen, not the state.
          if name not in ("_CHECKPOINTABLE_OBJECT_GRAPH", "save_counter/"
                          ".ATTRIBUTES/VARIABLE_VALUE")}


@pytest.mark.slow
def test_a_resumed_run_trains_the_decoder_as_an_uninterrupted_one(tmp_path):
  """2 steps, relaunched to 4 == 4 uninterrupted, bit for bit: the
  decoder's weights and its Adam slots are checkpointed and restored."""
  app = tmp_path / "vae.py"
  app.write_text(_VAE_APP)
  common = ["--model=mlp", "--hidden_units=8", "--dataset=synthetic",
            "--global_batch_size=8", "--optimizer=adam", "--eval_steps=1",
            "--export_saved_model=false"]

  def run(model_dir, steps):
    proc = helpers.run_python(str(app), *common, f"--model_dir={model_dir}",
                              f"--train_steps={steps}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return _checkpoint(model_dir)

  at_2 = run(tmp_path / "resumed", 2)
  resumed = run(tmp_path / "resumed", 4)
  whole = run(tmp_path / "whole", 4)
  # The decoder's weights, saved where the checkpoint first meets them: as
  # the optimizer's 5th and 6th (after the mlp's 4).
  decoder = [k for k in whole if re.match(r"optimizer/_trainable_variables/"
                                          r"[45]/", k)]
  # Adam's moments of the decoder's kernel (no weight of the mlp has its
  # shape).
  slots = [k for k in whole if k.startswith("optimizer/_variables/")
           and whole[k].shape == (5, 8)]
  assert len(decoder) == 2 and len(slots) == 2, sorted(whole)
  assert all(not np.array_equal(at_2[k], whole[k]) for k in decoder + slots)
  assert sorted(resumed) == sorted(whole)
  for name, value in whole.items():
    np.testing.assert_array_equal(resumed[name], value, err_msg=name)


def test_sharded_optimizer_state_trains_the_tracked_decoder_alike(one_device):
  _, after = _run(mirrored(), shard_optimizer_state=True)
  _assert_close(after, one_device[1], atol=1e-5)
