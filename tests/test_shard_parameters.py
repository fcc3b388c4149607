"""`shard_parameters` (ZeRO-3) on 2 mirrored replicas, in process: the
unsharded run's weights (SGD with momentum, Adam, AdamW; with and without
gradient accumulation; residual, dropout and BatchNorm models); each
device holds 1/N of every weight, gradient and slot, the model's whole
weights one copy on the host; each unit's weights are gathered twice per
step (forward, and again for the recomputed backward pass) and its
gradient reduce-scattered once; bad settings are one ConfigError."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import framework
from framework.errors import ConfigError
from framework.model_parallel import parameter_sharding
from shared_strategy import mirrored

# A size and seed of their own: 7 features, 9 hidden units (odd: each
# half is padded), 4 classes.
FEATURES, HIDDEN, CLASSES, SEED, BATCH, STEPS = 7, 9, 4, 71, 12, 4
OPTIMIZERS = {"momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
              "adam": lambda: keras.optimizers.Adam(3e-3),
              "adamw": lambda: keras.optimizers.AdamW(3e-3, weight_decay=0.1)}


def residual():
  x = keras.Input((FEATURES,))
  h = keras.layers.Dense(HIDDEN, activation="relu")(x)
  h = keras.layers.Add()([h, keras.layers.Dense(HIDDEN)(h)])
  return keras.Model(x, keras.layers.Dense(CLASSES)(h))


def stateful():
  """Dropout and BatchNorm: the recomputed backward pass must see the
  same masks, and the statistics must move once per step."""
  return keras.Sequential([
      keras.Input((FEATURES,)), keras.layers.Dense(HIDDEN),
      keras.layers.BatchNormalization(), keras.layers.Activation("relu"),
      keras.layers.Dropout(0.3), keras.layers.Dense(CLASSES)])


def make(sharded, optimizer="adam", build=residual, layers_per_unit=1,
         **kwargs):
  strategy = mirrored()
  keras.utils.set_random_seed(SEED)
  with strategy.scope():
    model = build()
    opt = OPTIMIZERS[optimizer]()
  cls = framework.Trainer
  if sharded:
    cls = parameter_sharding.sharded_trainer(cls, layers_per_unit)
    kwargs.update(shard_optimizer_state=True, shard_gradients=True)
  return cls(model, opt, strategy, global_batch_size=BATCH, **kwargs)


def batches(trainer):
  rng = np.random.default_rng(SEED)
  x = rng.normal(size=(STEPS * BATCH, FEATURES)).astype("float32")
  y = rng.integers(0, CLASSES, STEPS * BATCH).astype("int32")
  data = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH).repeat()
  return iter(trainer.strategy.experimental_distribute_dataset(data))


def trained(trainer, loops=1):
  iterator = batches(trainer)
  for _ in range(loops):
    trainer.train(iterator, STEPS // loops)
  return [v.numpy() for v in trainer.model.variables]


def max_diff(a, b):
  return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("accumulate", [1, 2])
def test_equals_unsharded(optimizer, accumulate):
  plain = trained(make(False, optimizer, grad_accum_steps=accumulate,
                       clip_norm=0.5))
  # Two loops: the weights are written out and cut into shards in between.
  sharded = trained(make(True, optimizer, grad_accum_steps=accumulate,
                         clip_norm=0.5), loops=2)
  assert max_diff(plain, sharded) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("layers_per_unit", [1, 2])
def test_dropout_and_batchnorm_equal_unsharded(layers_per_unit):
  plain = trained(make(False, "momentum", stateful))
  sharded = trained(make(True, "momentum", stateful, layers_per_unit))
  # Every variable, the BatchNorm statistics and the dropout seeds too.
  assert max_diff(plain, sharded) < 1e-5


def test_each_device_holds_its_half():
  trainer = make(True, "adam")
  sharding = trainer.parameter_sharding
  model_bytes = host_bytes = 0
  per_device = {}
  for variable, shard in zip(trainer.model.trainable_variables,
                             sharding.shards):
    count = int(np.prod(variable.shape))
    model_bytes += 4 * count
    # The whole weight: one copy, on the host, not one per replica.
    assert isinstance(variable.value, tf.Variable)
    assert not isinstance(variable.value, tf.distribute.DistributedValues)
    assert variable.value.device.endswith("CPU:0")
    host_bytes += 4 * count
    copies = trainer.strategy.experimental_local_results(shard.value)
    assert len(copies) == 2
    for copy in copies:
      assert copy.shape == ((count + 1) // 2,)
      per_device[copy.device] = per_device.get(copy.device, 0) + 4 * (
          (count + 1) // 2)
  # Weights by hand: the parameters (+1 padding per odd-sized variable),
  # halved.
  odd = sum(int(np.prod(v.shape)) % 2 for v in trainer.model.trainable_variables)
  half = (model_bytes + 4 * odd) // 2
  assert sorted(per_device.values()) == [half] * 2
  assert host_bytes == model_bytes
  # Adam's two slots per weight: on each device, twice its half.
  slot_bytes = {}
  for slot in trainer.optimizer_sharding.slot_variables():
    for copy in trainer.strategy.experimental_local_results(slot.value):
      slot_bytes[copy.device] = slot_bytes.get(copy.device, 0) + 4 * int(
          np.prod(copy.shape))
  assert sorted(slot_bytes.values()) == [2 * half] * 2
  # The gradients the update receives: shard-shaped, a half each.
  shapes = []
  apply = trainer.updater._apply  # pylint: disable=protected-access

  def recording(grads, *args, **kwargs):
    shapes.append([tuple(g.shape) for g in grads])
    return apply(grads, *args, **kwargs)

  trainer.updater._apply = recording  # pylint: disable=protected-access
  trainer.train(batches(trainer), 1)
  assert shapes and all(
      4 * sum(int(np.prod(s)) for s in traced) == half for traced in shapes)


def _collectives(trainer):
  """{op type: count} of the float collectives of one traced step (both
  replicas), nested functions (the recomputed units) included once each."""
  step = tf.function(trainer.distributed_train_step)
  graph = step.get_concrete_function(next(batches(trainer))).graph
  counts, seen = {}, set()

  def walk(g):
    for op in g.get_operations():
      if (op.type.startswith("Collective") and op.outputs
          and op.outputs[0].dtype.is_floating):
        counts[op.type] = counts.get(op.type, 0) + 1
    for name, function in g._functions.items():  # pylint: disable=protected-access
      if name not in seen and hasattr(function, "graph"):
        seen.add(name)
        walk(function.graph)

  walk(graph)
  return counts


def test_each_unit_is_gathered_twice_and_scattered_once():
  trainer = make(True, "adam")
  counts = _collectives(trainer)
  variables = len(trainer.model.trainable_variables)
  # Forward and the recomputed backward pass, per variable and replica.
  gathers = sum(n for op, n in counts.items() if "Gather" in op)
  scatters = sum(n for op, n in counts.items() if "AllToAll" in op)
  assert gathers == 2 * variables * 2, counts
  assert scatters == variables * 2, counts


def test_evaluation_reads_the_written_weights():
  trainer = make(True, "adam")
  trained(trainer)
  x = np.random.default_rng(1).normal(size=(5, FEATURES)).astype("float32")
  reference = make(False, "adam")
  for a, b in zip(reference.model.variables, trainer.model.variables):
    a.assign(b.numpy())
  np.testing.assert_allclose(trainer.model(x), reference.model(x), atol=1e-6)


@pytest.mark.parametrize("kwargs,named", [
    (dict(shard_gradients=False), "shard_gradients"),
    (dict(ema_decay=0.9), "ema_decay"),
    (dict(log_layer_norms=True), "log_layer_norms"),
])
def test_bad_settings_are_one_config_error(kwargs, named):
  strategy = mirrored()
  with strategy.scope():
    model = residual()
    opt = keras.optimizers.Adam()
  cls = parameter_sharding.sharded_trainer(framework.Trainer)
  options = dict(dict(shard_optimizer_state=True, shard_gradients=True,
                      global_batch_size=BATCH), **kwargs)
  with pytest.raises(ConfigError, match=named):
    cls(model, opt, strategy, **options)


@pytest.mark.parametrize("trainer_cls,units", [
    ("Trainer", 0), ("Trainer", -1), ("Trainer", 1.5), ("Trainer", "2"),
    ("Trainer", None), ("Trainer", True), (object, 1), ("sharded", 1)])
def test_a_bad_unit_size_or_class_is_one_config_error(trainer_cls, units):
  """sharded_trainer's own arguments: K >= 1 layers a unit, of a Trainer
  not sharded already (0 was a raw range() error, -1 trained silently)."""
  if trainer_cls == "Trainer":
    trainer_cls = framework.Trainer
  elif trainer_cls == "sharded":
    trainer_cls = parameter_sharding.sharded_trainer(framework.Trainer)
  with pytest.raises(ConfigError, match="sharded_trainer"):
    parameter_sharding.sharded_trainer(trainer_cls, units)


def test_one_replica_is_refused():
  strategy = framework.make_strategy("one_device")
  with strategy.scope():
    model = residual()
    opt = keras.optimizers.Adam()
  cls = parameter_sharding.sharded_trainer(framework.Trainer)
  with pytest.raises(ConfigError, match="replicas"):
    cls(model, opt, strategy, global_batch_size=BATCH,
        shard_optimizer_state=True, shard_gradients=True)


def test_a_weight_regulariser_is_refused():
  strategy = mirrored()
  with strategy.scope():
    x = keras.Input((FEATURES,))
    model = keras.Model(x, keras.layers.Dense(
        CLASSES, kernel_regularizer="l2")(x))
    opt = keras.optimizers.Adam()
  cls = parameter_sharding.sharded_trainer(framework.Trainer)
  with pytest.raises(ConfigError, match="kernel_regularizer"):
    cls(model, opt, strategy, global_batch_size=BATCH,
        shard_optimizer_state=True, shard_gradients=True)


class ReadsAnother(keras.layers.Layer):
  """Reads a weight of another top-level layer, not through itself."""

  def __init__(self, source, **kwargs):
    super().__init__(**kwargs)
    self._source = lambda: source  # a function: Keras does not track it

  def call(self, x):
    return x @ keras.ops.transpose(self._source().kernel)


class AddsLoss(keras.layers.Layer):

  def call(self, x):
    self.add_loss(keras.ops.mean(x ** 2))
    return x


def _train_built(build):
  strategy = mirrored()
  with strategy.scope():
    model = build()
    opt = keras.optimizers.SGD(0.1)
  cls = parameter_sharding.sharded_trainer(framework.Trainer)
  trainer = cls(model, opt, strategy, global_batch_size=BATCH,
                shard_optimizer_state=True, shard_gradients=True)
  trainer.train(batches(trainer), 1)


def test_a_weight_read_outside_its_layer_is_refused():
  def build():
    x = keras.Input((FEATURES,))
    first = keras.layers.Dense(FEATURES)
    return keras.Model(x, ReadsAnother(first)(first(x)))

  with pytest.raises(ConfigError, match="outside the top-level layer"):
    _train_built(build)


def test_a_layer_loss_is_refused():
  def build():
    x = keras.Input((FEATURES,))
    return keras.Model(x, keras.layers.Dense(CLASSES)(AddsLoss()(x)))

  with pytest.raises(ConfigError, match="add losses"):
    _train_built(build)


@pytest.mark.slow
def test_bfloat16_compute_equals_unsharded():
  """Layers computing in bfloat16 read the shards in float32 (a shard is
  gathered inside the layer call, where Keras would autocast it)."""
  policy = keras.mixed_precision.global_policy()
  keras.mixed_precision.set_global_policy("mixed_bfloat16")
  try:
    plain = trained(make(False, "adam"))
    sharded = trained(make(True, "adam"))
  finally:
    keras.mixed_precision.set_global_policy(policy)
  assert max_diff(plain, sharded) < 1e-5


@pytest.mark.slow
def test_gpt_equals_unsharded():
  """The GPT: its tied embedding is gathered by two units (the input
  embedding and the output head) and gets both gradients."""
  import models  # pylint: disable=g-import-not-at-top

  def gpt():
    return models.build_model("gpt", (8,), 32, num_layers=2, model_width=16,
                              num_heads=2, tie_embeddings=True)

  def run(sharded):
    trainer = make(sharded, "adamw", gpt)
    rng = np.random.default_rng(SEED)
    tokens = rng.integers(0, 32, (STEPS * BATCH, 9)).astype("int32")
    data = tf.data.Dataset.from_tensor_slices(
        (tokens[:, :-1], tokens[:, 1:])).batch(BATCH).repeat()
    trainer.train(iter(trainer.strategy.experimental_distribute_dataset(
        data)), STEPS)
    return [v.numpy() for v in trainer.model.variables]

  assert max_diff(run(False), run(True)) < 1e-5


@pytest.mark.parametrize("flags,named", [
    (dict(shard_optimizer_state=False, shard_gradients=False),
     "shard_optimizer_state"),
    (dict(shard_gradients=False), "shard_gradients"),
    (dict(strategy="parameter_server"), "parameter_server"),
    (dict(strategy="central_storage"), "central_storage"),
    (dict(model_parallel=dict(recompute="blocks")), "recompute=blocks"),
    (dict(ema_decay=0.9), "ema_decay"),
    (dict(check_distribution=True), "check_distribution"),
    (dict(jit_compile=True), "jit_compile"),
])
def test_bad_combinations_are_one_config_error(flags, named):
  from framework.app.config import ExperimentConfig  # pylint: disable=g-import-not-at-top
  from framework.model_parallel.config import ModelParallelConfig  # pylint: disable=g-import-not-at-top
  options = dict(train_steps=2, shard_optimizer_state=True,
                 shard_gradients=True, shard_parameters=True,
                 strategy="mirrored")
  options.update(flags)
  if "model_parallel" in options:
    options["model_parallel"] = ModelParallelConfig(**options["model_parallel"])
  with pytest.raises(ConfigError, match=named):
    ExperimentConfig(**options)
