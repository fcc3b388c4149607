"""The distribution check: wrong custom steps are caught and named; correct
steps pass. Runs on the 2 logical CPU devices of tests/conftest.py."""

import functools
import os
import re

import h5py
import keras
import numpy as np
import pytest
import tensorflow as tf

import framework
import framework.check.distribution_check  # noqa: F401  (the attribute chain below)
import framework.app.experiment  # noqa: F401  (the attribute chain below)
from framework.check import distribution_check
from framework.model_parallel import ModelParallelConfig
from framework.core.trainer import Trainer
from tests.helpers import run_script

GLOBAL_BATCH = 16
SUM = tf.distribute.ReduceOp.SUM


def build_mlp():
  # Only the first kernel is regularised: the unscaled-regularisation bug
  # then shows on that variable alone.
  return keras.Sequential([
      keras.Input((8,)),
      keras.layers.Dense(16, activation="relu",
                         kernel_regularizer=keras.regularizers.L2(0.05)),
      keras.layers.Dense(4)])


def build_bn_dropout():
  return keras.Sequential([
      keras.Input((8,)), keras.layers.Dense(16),
      keras.layers.BatchNormalization(), keras.layers.ReLU(),
      keras.layers.Dropout(0.5), keras.layers.Dense(4)])


@pytest.fixture(scope="module")
def batch():
  rng = np.random.default_rng(0)
  return (rng.normal(size=(GLOBAL_BATCH, 8)).astype(np.float32),
          rng.integers(0, 4, GLOBAL_BATCH).astype(np.int32))


@pytest.fixture(scope="module")
def mirrored():
  strategy = framework.make_strategy("mirrored")
  assert strategy.num_replicas_in_sync == 2
  return strategy


def check(trainer_cls, strategy, batch, build=build_mlp, **kwargs):
  return framework.check.distribution_check.check_trainer_class(
      trainer_cls, build, lambda: keras.optimizers.Adam(1e-3), strategy,
      batch, global_batch_size=GLOBAL_BATCH, **kwargs)


# --- Deliberately wrong steps. -----------------------------------------------


def scaled_regularization(model):
  if not model.losses:
    return 0.0
  return tf.nn.scale_regularization_loss(tf.add_n(model.losses))


class LossPerReplicaMean(Trainer):
  """Divides by the per-replica batch: tf.reduce_mean inside the replica."""

  def train_step(self, batch):
    x, y = batch
    with tf.GradientTape() as tape:
      logits = self.model(x, training=True)
      loss = tf.reduce_mean(self.loss_fn(y, logits))
      loss += scaled_regularization(self.model)
    grads = self.all_reduce(tape.gradient(loss,
                                          self.model.trainable_variables))
    self.apply_gradients(grads)
    return {"loss": loss}


class DoubleAllReduce(Trainer):
  """Reduces, then calls Keras's apply_gradients, which reduces again."""

  def train_step(self, batch):
    x, y = batch
    with tf.GradientTape() as tape:
      loss = self.average(self.loss_fn(y, self.model(x, training=True)))
      loss += scaled_regularization(self.model)
    grads = self.all_reduce(tape.gradient(loss,
                                          self.model.trainable_variables))
    self.optimizer.apply_gradients(zip(grads, self.model.trainable_variables))
    return {"loss": loss}


class UnscaledRegularization(Trainer):
  """Adds the whole regularisation loss on every replica."""

  def train_step(self, batch):
    x, y = batch
    with tf.GradientTape() as tape:
      loss = self.average(self.loss_fn(y, self.model(x, training=True)))
      loss += tf.add_n(self.model.losses)
    grads = self.all_reduce(tape.gradient(loss,
                                          self.model.trainable_variables))
    self.apply_gradients(grads)
    return {"loss": loss}


class ClipPerReplica(Trainer):
  """Clips each replica's gradient share before the all-reduce."""

  def train_step(self, batch):
    x, y = batch
    with tf.GradientTape() as tape:
      loss = self.average(self.loss_fn(y, self.model(x, training=True)))
      loss += scaled_regularization(self.model)
    grads = tape.gradient(loss, self.model.trainable_variables)
    grads, _ = self.clip_by_global_norm(grads)
    self.apply_gradients(self.all_reduce(grads))
    return {"loss": loss}


class MetricFromOneReplica(Trainer):
  """Reports the loss of replica 0 only (the step itself is right)."""

  def train_step(self, batch):
    x, y = batch
    metrics = super().train_step(batch)
    context = tf.distribute.get_replica_context()
    first = tf.cast(tf.equal(context.replica_id_in_sync_group, 0), tf.float32)
    logits = self.model(x, training=False)
    metrics["loss"] = first * tf.reduce_mean(self.loss_fn(y, logits))
    return metrics


class MeanAllReduce(Trainer):
  """Averages the gradient shares (MEAN) instead of summing them."""

  def train_step(self, batch):
    x, y = batch
    with tf.GradientTape() as tape:
      loss = self.average(self.loss_fn(y, self.model(x, training=True)))
      loss += scaled_regularization(self.model)
    grads = tape.gradient(loss, self.model.trainable_variables)
    context = tf.distribute.get_replica_context()
    self.apply_gradients(context.all_reduce(tf.distribute.ReduceOp.MEAN,
                                            grads))
    return {"loss": loss}


class NoAllReduce(Trainer):
  """Applies each replica's own gradient: the replicas drift apart."""

  def train_step(self, batch):
    x, y = batch
    with tf.GradientTape() as tape:
      loss = self.average(self.loss_fn(y, self.model(x, training=True)))
    grads = tape.gradient(loss, self.model.trainable_variables)
    grads = [g * self.num_replicas for g in grads]
    context = tf.distribute.get_replica_context()
    variables = self.model.trainable_variables


    def update(strategy, grads):
      for v, g in zip(variables, grads):
        strategy.extended.update(v.value, lambda v, d: v.assign_sub(d),
                                 args=(g,))

    context.merge_call(update, args=(grads,))
    return {"loss": loss}


@pytest.mark.parametrize("trainer_cls,cause,extra", [
    (LossPerReplicaMean, "loss_per_replica_mean", {}),
    (DoubleAllReduce, "double_all_reduce", {}),
    (UnscaledRegularization, "unscaled_regularization", {}),
    (ClipPerReplica, "clip_before_reduce", {"clip_norm": 1e-2}),
    (MetricFromOneReplica, "metric_one_replica", {}),
    (MeanAllReduce, "mean_all_reduce", {}),
])
def test_wrong_step_is_caught_and_named(trainer_cls, cause, extra, batch,
                                        mirrored):
  report = check(trainer_cls, mirrored, batch, **extra)
  assert report.verdict == "fail"
  assert report.cause_codes == [cause], report.table()
  assert cause in report.table()


def test_unscaled_regularisation_differs_on_the_regularised_kernel_only(
    batch, mirrored):
  report = check(UnscaledRegularization, mirrored, batch)
  # Rows follow the layers: only the first Dense (the regularised one) is off.
  update_ok = [r.ok for r in report.rows if r.section == "update"]
  assert update_ok == [False, True], report.table()


def test_clipping_bug_is_invisible_when_clipping_is_inactive(batch, mirrored):
  # Large clip_norm: per-replica clipping never clips, so the step is right.
  report = check(ClipPerReplica, mirrored, batch, clip_norm=1e6)
  assert report.verdict == "pass", report.table()


# --- Correct steps: no false alarm. -------------------------------------------


@pytest.mark.parametrize("strategy_name", ["mirrored", "central_storage"])
def test_builtin_step_passes(strategy_name, batch, mirrored):
  strategy = (mirrored if strategy_name == "mirrored" else
              framework.make_strategy(strategy_name))
  report = check(Trainer, strategy, batch, clip_norm=0.05)
  assert report.verdict == "pass", report.table()
  assert not report.causes and not report.warnings
  sections = {r.section for r in report.rows}
  assert sections >= {"update", "optimizer", "metric", "replicas"}
  metrics = {r.name for r in report.rows if r.section == "metric"}
  assert metrics == {"loss", "accuracy", "grad_norm"}


class TwoDeviceSplit(Trainer):
  """A toy model split under the default strategy: layer k on device k."""

  def train_step(self, batch):
    x, y = batch
    with tf.GradientTape() as tape:
      h = x
      for k, layer in enumerate(self.model.layers):
        with tf.device(f"/cpu:{k % 2}"):
          h = layer(h, training=True)
      loss = self.average(self.loss_fn(y, h))
      loss += scaled_regularization(self.model)
    grads = tape.gradient(loss, self.model.trainable_variables)
    self.apply_gradients(self.all_reduce(grads))
    return {"loss": loss}


def test_a_split_trainer_under_the_default_strategy_passes(batch):
  # Factories are all the check needs: any trainer, strategy or split.
  def make(device):
    def factory():
      strategy = (tf.distribute.get_strategy() if device is None else
                  tf.distribute.OneDeviceStrategy(device))
      with strategy.scope():
        model, optimizer = build_mlp(), keras.optimizers.SGD(0.1)
      return TwoDeviceSplit(model, optimizer, strategy,
                            global_batch_size=GLOBAL_BATCH)
    return factory

  report = framework.check.distribution_check.check_distribution(make(None), make("/cpu:0"), batch)
  assert report.verdict == "pass", report.table()


def test_own_optimizer_slots_are_compared(batch, mirrored):
  # Without the probe, Adam's own slots are compared (and equal).
  report = check(Trainer, mirrored, batch, probe_optimizer=False)
  assert report.verdict == "pass", report.table()
  kinds = {r.name for r in report.rows if r.section == "optimizer"}
  assert {"momentum", "velocity"} <= kinds


def test_batch_norm_and_dropout_warn_but_the_step_is_checked(batch, mirrored):
  report = check(Trainer, mirrored, batch, build=build_bn_dropout)
  assert report.verdict == "warn", report.table()
  assert set(report.warning_codes) == {"batch_norm_unsynchronized", "dropout"}
  # The rest is still compared exactly: a wrong step on this model fails.
  report = check(LossPerReplicaMean, mirrored, batch, build=build_bn_dropout)
  assert report.cause_codes == ["loss_per_replica_mean"], report.table()


def test_a_model_computing_in_bfloat16_is_named(batch, mirrored):
  # Its rounding can exceed the tolerance on a correct step: the warning
  # says so and how to check in float32.
  policy = keras.mixed_precision.global_policy()
  keras.mixed_precision.set_global_policy("mixed_bfloat16")
  try:
    report = check(Trainer, mirrored, batch)
  finally:
    keras.mixed_precision.set_global_policy(policy)
  assert "low_precision" in report.warning_codes, report.table()
  assert "low_precision" not in check(Trainer, mirrored, batch).warning_codes


def test_a_trainer_instance_is_restored_exactly(batch, mirrored):
  with mirrored.scope():
    model = build_bn_dropout()
    optimizer = keras.optimizers.Adam(1e-3)
  trainer = NoAllReduce(model, optimizer, mirrored,
                        global_batch_size=GLOBAL_BATCH)
  before = [[c.numpy() for c in mirrored.experimental_local_results(v.value)]
            for v in model.variables + optimizer.variables]

  def reference():
    one = framework.make_strategy("one_device")
    with one.scope():
      return NoAllReduce(build_bn_dropout(), keras.optimizers.Adam(1e-3), one,
                         global_batch_size=GLOBAL_BATCH)

  report = framework.check.distribution_check.check_distribution(trainer, reference, batch)
  assert "not_all_reduced" in report.cause_codes, report.table()
  assert trainer.optimizer is optimizer
  assert model.layers[3].rate == 0.5 and not model.layers[1].synchronized
  after = [[c.numpy() for c in mirrored.experimental_local_results(v.value)]
           for v in model.variables + optimizer.variables]
  for old, new in zip(before, after):
    for a, b in zip(old, new):
      np.testing.assert_array_equal(a, b)


# --- Randomness, penalties, steps that never apply. ----------------------------


def noisy(batch):
  """`batch` with Gaussian noise on the features (a fresh draw per call)."""
  features, labels = batch
  return features + tf.random.normal(tf.shape(features), stddev=0.3), labels


class NoisyInputs(Trainer):
  """A correct step that adds input noise with a hand-written tf.random op."""

  def compute_gradients(self, batch):
    return super().compute_gradients(noisy(batch))


class NoisyLossPerReplicaMean(LossPerReplicaMean):
  """Input noise AND the loss averaged over the per-replica batch (wrong)."""

  def train_step(self, batch):
    return super().train_step(noisy(batch))


def build_gaussian_noise():
  return keras.Sequential([
      keras.Input((8,)), keras.layers.GaussianNoise(0.5),
      keras.layers.Dense(16, activation="relu"),
      keras.layers.GaussianDropout(0.3), keras.layers.Dense(4)])


class UnscaledPenalty(Trainer):
  """A hand-written L2 penalty added in full on every replica (wrong)."""

  def train_step(self, batch):
    x, y = batch
    with tf.GradientTape() as tape:
      loss = self.average(self.loss_fn(y, self.model(x, training=True)))
      loss += 0.05 * tf.add_n([tf.reduce_sum(tf.square(w))
                               for w in self.model.trainable_variables])
    grads = self.all_reduce(tape.gradient(loss,
                                          self.model.trainable_variables))
    self.apply_gradients(grads)
    return {"loss": loss}


class NeverApplies(Trainer):
  """Computes the gradient but never applies it (wrong on any device)."""

  def train_step(self, batch):
    grads, metrics = self.compute_gradients(batch)
    del grads
    return metrics


def test_traced_random_ops_draw_their_mean_only_inside_the_check():
  from framework.check import distribution_step  # pylint: disable=g-import-not-at-top
  keras.utils.set_random_seed(0)  # op determinism (conftest) wants a seed
  generator = tf.random.Generator.from_seed(1)
  seeds = keras.random.SeedGenerator(3)

  @tf.function
  def draw():
    return (tf.random.normal([3]), tf.random.uniform([3], -1.0, 3.0),
            keras.random.normal([3], seed=seeds), generator.uniform([3]),
            tf.random.stateless_truncated_normal([3], seed=[1, 2]),
            tf.random.shuffle(tf.range(3)))

  with distribution_step.neutralised() as draws:
    values = [v.numpy() for v in draw()]
    draws.scan(draw.get_concrete_function().graph)
  # Centres: normal 0, uniform [-1, 3) at 0.5 of the way, i.e. 1.
  for value, centre in zip(values, [0.0, 1.0, 0.0, 0.5, 0.0]):
    np.testing.assert_array_equal(value, np.full(3, centre, np.float32))
  replaced = " ".join(draws.replaced_ops)
  for op in ("RandomStandardNormal", "RandomUniform", "StatelessRandomNormalV2",
             "StatelessRandomUniformV2", "StatelessTruncatedNormalV2"):
    assert op in replaced, draws.replaced_ops
  # A shuffle has no centre: it is left drawing, and named.
  assert [op.split()[0] for op in draws.left_ops] == ["RandomShuffle"]
  # Outside the check TensorFlow draws again, traced or eager.
  assert np.std(tf.function(lambda: tf.random.normal([100]))().numpy()) > 0.5
  assert np.std(tf.random.normal([100]).numpy()) > 0.5


def test_correct_step_with_hand_written_noise_passes_with_a_warning(
    batch, mirrored):
  report = check(NoisyInputs, mirrored, batch)
  assert report.verdict == "warn", report.table()
  assert report.warning_codes == ["random_ops"], report.table()
  # The op, and where the step drew it.
  assert "RandomStandardNormal at noisy" in report.warnings[0].message
  # The deterministic rest is compared as closely as without noise.
  assert all(r.ok for r in report.rows), report.table()


def test_noise_layers_pass_with_a_warning(batch, mirrored):
  report = check(Trainer, mirrored, batch, build=build_gaussian_noise)
  assert report.verdict == "warn", report.table()
  assert report.warning_codes == ["random_layers"], report.table()
  message = report.warnings[0].message
  assert "gaussian_noise" in message and "gaussian_dropout" in message
  # The same model with a wrong step still fails, and is named.
  report = check(LossPerReplicaMean, mirrored, batch,
                 build=build_gaussian_noise)
  assert report.cause_codes == ["loss_per_replica_mean"], report.table()


def build_random_flip():
  return keras.Sequential([
      keras.Input((8,)), keras.layers.Reshape((2, 4, 1)),
      keras.layers.RandomFlip("horizontal"), keras.layers.Flatten(),
      keras.layers.Dense(4)])


def test_a_random_preprocessing_layer_is_named(batch, mirrored):
  # Keras's preprocessing layers keep their SeedGenerator under another
  # attribute than Dropout's: named all the same.
  report = check(Trainer, mirrored, batch, build=build_random_flip)
  assert "random_layers" in report.warning_codes, report.table()
  message = report.warnings[report.warning_codes.index("random_layers")]
  assert "random_flip drawing their mean" in message.message
  assert not report.causes, report.table()


def test_wrong_stochastic_step_still_fails_and_is_named(batch, mirrored):
  report = check(NoisyLossPerReplicaMean, mirrored, batch)
  assert report.verdict == "fail"
  assert report.cause_codes == ["loss_per_replica_mean"], report.table()
  assert report.warning_codes == ["random_ops"], report.table()


def test_unscaled_hand_written_penalty_is_named(batch, mirrored):
  report = check(UnscaledPenalty, mirrored, batch)
  assert report.cause_codes == ["unscaled_penalty"], report.table()
  message = report.causes[0].message
  assert "tf.nn.scale_regularization_loss" in message
  assert "statistics" not in message and "independent of the data" in message
  # The loss offset is (replicas - 1) x the penalty at the starting weights
  # (the check builds the model first, after seeding with 0).
  keras.utils.set_random_seed(0)
  model = build_mlp()
  penalty = 0.05 * sum(float(np.sum(np.square(w.numpy())))
                       for w in model.trainable_variables)
  found = re.search(r"\(2 - 1\) x ([0-9.e+-]+)", message)
  assert found, message
  np.testing.assert_allclose(float(found.group(1)), penalty, rtol=1e-3)


def test_a_step_that_never_applies_reports_both_counts(batch, mirrored):
  report = check(NeverApplies, mirrored, batch)
  assert report.cause_codes == ["optimizer_steps"], report.table()
  message = report.causes[0].message
  assert "0 times on 2 replicas and 0 times on one device" in message
  assert "(1 on one device)" not in message


# --- The experiment and the script. -------------------------------------------


def _config(model_dir, check):
  return framework.ExperimentConfig(
      model="mlp", dataset="synthetic", model_dir=str(model_dir),
      strategy="mirrored", global_batch_size=32, train_steps=2,
      check_distribution=check, model_options={"hidden_units": (16,)},
      loop=framework.LoopConfig(train_steps=2, steps_per_loop=2,
                                checkpoint_every=0))


def _weights(path):
  out = []
  with h5py.File(path, "r") as f:
    f.visititems(lambda name, obj: out.append((name, np.array(obj)))
                 if isinstance(obj, h5py.Dataset) else None)
  return out


def test_check_does_not_change_the_run(tmp_path, capsys, mirrored):
  # One strategy object for both runs: separate MirroredStrategy objects in
  # one process reuse collective keys, which the runtime rejects.
  framework.app.experiment.run(_config(tmp_path / "plain", False),
                           strategy=mirrored)
  framework.app.experiment.run(_config(tmp_path / "checked", True),
                           strategy=mirrored)
  assert "verdict: PASS" in capsys.readouterr().out
  plain = _weights(tmp_path / "plain" / "model.weights.h5")
  checked = _weights(tmp_path / "checked" / "model.weights.h5")
  assert [n for n, _ in plain] == [n for n, _ in checked] and plain
  for (_, a), (_, b) in zip(plain, checked):
    np.testing.assert_array_equal(a, b)


CUSTOM_SCRIPT = """
import sys
sys.path.insert(0, {root!r})
sys.path.insert(0, {tests!r})
from absl import app
from scripts import train
from test_distribution_check import {cls}
app.run(lambda argv: train.run_main({cls}))
"""


def _custom_script(tmp_path, cls):
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  script = tmp_path / "custom_train.py"
  script.write_text(CUSTOM_SCRIPT.format(
      root=root, tests=os.path.join(root, "tests"), cls=cls))
  return str(script)


def test_script_fails_a_wrong_custom_step(tmp_path):
  script = _custom_script(tmp_path, "DoubleAllReduce")
  proc = run_script(
      script, "--check_distribution", "--model=mlp",
      "--dataset=synthetic", "--strategy=mirrored", "--cpu_devices=2",
      "--train_steps=2", "--global_batch_size=32", "--optimizer=sgd",
      f"--model_dir={tmp_path / 'run'}", check=False)
  assert proc.returncode == 1, proc.stderr[-3000:]
  assert "update  " in proc.stdout or "update" in proc.stdout
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith("custom_train.py: error: distribution check failed: "
                         "double_all_reduce"), last
  assert not os.path.exists(tmp_path / "run" / "model.weights.h5")


def test_script_trains_after_checking_a_correct_noisy_step(tmp_path):
  script = _custom_script(tmp_path, "NoisyInputs")
  proc = run_script(
      script, "--check_distribution", "--model=mlp",
      "--dataset=synthetic", "--strategy=mirrored", "--cpu_devices=2",
      "--train_steps=2", "--global_batch_size=32", "--optimizer=sgd",
      f"--model_dir={tmp_path / 'run'}", check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "verdict: WARN" in proc.stdout, proc.stdout[-3000:]
  assert "WARN random_ops: random ops in the step (RandomStandardNormal at " \
      "noisy" in proc.stdout
  assert os.path.exists(tmp_path / "run" / "model.weights.h5")


@pytest.mark.parametrize("split", [
    ModelParallelConfig(mode="pipeline", num_stages=2, num_microbatches=4),
    ModelParallelConfig(mode="tensor", num_shards=2, num_microbatches=1),
], ids=["pipeline", "tensor"])
def test_model_parallel_splits_pass(batch, split):
  # The split model (one replica, layers or units over 2 devices) against
  # the unsplit built-in step on one device: no false alarm.
  def factory(strategy, trainer_cls):
    def make():
      with strategy.scope():
        model = keras.Sequential([  # model parallelism takes no regularisers
            keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(4)])
        optimizer = keras.optimizers.SGD(0.1)
      return trainer_cls(model, optimizer, strategy,
                         global_batch_size=GLOBAL_BATCH)
    return make

  split_cls = split.trainer_factory(Trainer)
  if split.mode == "tensor":
    # The same shards, all on one device: the variables match one to one.
    reference = factory(tf.distribute.get_strategy(), functools.partial(
        split_cls, devices=["/CPU:0", "/CPU:0"]))
  else:
    reference = factory(framework.make_strategy("one_device"), Trainer)
  keras.utils.set_random_seed(0)
  report = framework.check.distribution_check.check_distribution(
      factory(tf.distribute.get_strategy(), split_cls), reference, batch)
  assert report.verdict == "pass", report.table()
