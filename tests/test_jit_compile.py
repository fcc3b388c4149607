"""`jit_compile`: XLA steps train the same as plain steps (within float32
rounding), on one device and on 2 mirrored replicas.

Tolerance: XLA fuses and reorders the float32 arithmetic, so after 4 steps
of an MLP the weights agree to 1e-5 relative / 1e-6 absolute, the metrics to
1e-5; a wrong step (a missed or doubled all-reduce, a skipped update) is off
by far more (a factor 2 in the learning rate moves the weights by ~1e-2).
"""

import numpy as np
import pytest
import tensorflow as tf

import framework
import framework.core.optimizers  # noqa: F401  (the attribute chain below)
import framework.data.datasets  # noqa: F401  (the attribute chain below)
import framework.data.inputs  # noqa: F401  (the attribute chain below)
from framework.core import trainer as trainer_lib
import models
from tests import shared_strategy

RTOL, ATOL = 1e-5, 1e-6


def _train(strategy, data, jit_compile, steps=4, **options):
  tf.keras.utils.set_random_seed(3)
  with strategy.scope():
    model = models.build_model("mlp", data.input_shape, 10,
                               hidden_units=(16, 16))
    optimizer = framework.core.optimizers.make_optimizer(
        framework.OptimizerConfig(name="adam", learning_rate=0.01))
  trainer = framework.Trainer(model, optimizer, strategy,
                              global_batch_size=32, jit_compile=jit_compile,
                              **options)
  iterator = iter(framework.data.inputs.distribute_train(strategy, data, 32))
  metrics = trainer.train(iterator, steps)
  return (trainer, [w.numpy() for w in model.weights],
          {k: float(v) for k, v in metrics.items()},
          int(optimizer.iterations.numpy()))


@pytest.fixture(scope="module")
def data():
  return framework.data.datasets.synthetic(num_train=256, num_test=8,
                                           image_shape=(4, 4, 3))


@pytest.mark.parametrize("where,mode", [("one_device", trainer_lib.STEP),
                                        ("mirrored", trainer_lib.GRADIENTS)])
@pytest.mark.parametrize("options", [{}, {"clip_norm": 0.5,
                                          "nan_policy": "skip"}],
                         ids=["plain", "clip_skip"])
def test_xla_steps_equal_plain_steps(data, where, mode, options):
  strategy = (tf.distribute.get_strategy() if where == "one_device"
              else shared_strategy.mirrored())
  plain, plain_weights, plain_metrics, plain_updates = _train(
      strategy, data, False, **options)
  jitted, weights, metrics, updates = _train(strategy, data, True, **options)
  assert plain.jit_compile is None and jitted.jit_compile == mode
  assert updates == plain_updates == 4
  for a, b in zip(weights, plain_weights):
    np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)
  # And the steps did move the weights (equal because both trained).
  tf.keras.utils.set_random_seed(3)
  initial = models.build_model("mlp", data.input_shape, 10,
                               hidden_units=(16, 16))
  assert not np.allclose(initial.weights[0].numpy(), weights[0], atol=1e-3)
  for name in ("loss", "accuracy", "grad_norm"):
    assert metrics[name] == pytest.approx(plain_metrics[name], rel=RTOL,
                                          abs=ATOL)


def test_the_replicas_gradients_are_compiled(data):
  mirrored, _, _, _ = _train(shared_strategy.mirrored(), data, True, steps=1)
  assert hasattr(mirrored.compute_gradients, "experimental_get_compiler_ir")


def test_an_op_without_xla_kernel_is_one_line():
  error = tf.errors.InvalidArgumentError(
      None, None, "Detected unsupported operations when trying to compile "
      "graph __inference_step_123[_XlaMustCompile=true] on XLA_CPU_JIT: "
      "DecodePng (No registered 'DecodePng' OpKernel for XLA_CPU_JIT devices "
      "compatible with node {{node DecodePng}})")
  line = trainer_lib.compile_error(error)
  assert line == ("jit_compile: the step's op DecodePng has no XLA kernel "
                  "here; run without jit_compile")
  assert trainer_lib.compile_error(ValueError("other")) is None


class _HostOpTrainer(framework.Trainer):
  """A metric through a host Python function, which XLA cannot compile."""

  def compute_loss(self, batch):
    loss, metrics = super().compute_loss(batch)
    host = tf.numpy_function(lambda x: x, [metrics["accuracy"]], tf.float32,
                             stateful=False)
    return loss, {**metrics, "host": tf.reshape(host, [])}


@pytest.mark.parametrize("where", ["one_device", "mirrored"])
def test_the_step_is_compiled_an_op_xla_lacks_is_one_line(data, where):
  strategy = (tf.distribute.get_strategy() if where == "one_device"
              else shared_strategy.mirrored())
  with strategy.scope():
    model = models.build_model("mlp", data.input_shape, 10, hidden_units=(8,))
    optimizer = framework.core.optimizers.make_optimizer(
        framework.OptimizerConfig(name="sgd", learning_rate=0.01))
  trainer = _HostOpTrainer(model, optimizer, strategy, global_batch_size=32,
                           jit_compile=True)
  iterator = iter(framework.data.inputs.distribute_train(strategy, data, 32))
  with pytest.raises(framework.ConfigError) as raised:
    trainer.train(iterator, 1)
  print(raised.value)
  assert str(raised.value).startswith("jit_compile: ")
  assert "PyFunc" in str(raised.value)
  assert "\n" not in str(raised.value)


def test_the_flag_reaches_the_trainer(tmp_path):
  from framework.app import experiment  # pylint: disable=g-import-not-at-top
  seen = {}
  config = framework.ExperimentConfig(
      model="mlp", dataset="synthetic", model_dir=str(tmp_path / "run"),
      global_batch_size=32, train_steps=2, jit_compile=True,
      model_options={"hidden_units": (8,)}, export_saved_model=False,
      loop=framework.LoopConfig(train_steps=2, steps_per_loop=2))
  results = experiment.run(config, prepare_controller=lambda c: seen.update(
      mode=c.trainer.jit_compile))
  assert seen["mode"] == trainer_lib.STEP and results["examples"] > 0
