"""distloop: an explicit custom training loop on tf.distribute.

    import framework
    framework.configure_cpu_devices(2)          # before TensorFlow starts
    strategy = framework.make_strategy("mirrored")
    ...  # a Keras model and optimizer under strategy.scope()
    trainer = framework.Trainer(model, optimizer, strategy,
                                global_batch_size=64)
    framework.Controller(trainer, framework.LoopConfig(train_steps=1000),
                         "runs/mine", train_input=...).run()
    # or, a whole run from a config: framework.run(framework.ExperimentConfig(...))

The public API (`__all__`) is re-exported here and imported on first use (PEP 562), so
that TensorFlow-free modules such as `framework.distribute.launcher` load
without starting TensorFlow. The package is layered, lowest first (a module
imports only its own layer and lower ones; tests/test_import_graph.py checks):

    errors          the exception types every layer raises
    distribute/     strategies, TF_CONFIG, clusters, the launcher
    data/           datasets (arrays, TFRecords, image folders), tf.data input
    perf/           FLOP counting, profiling
    core/           Trainer, Controller, checkpoints, summaries, optimizers,
                    precision, preemption, parameter-server stepping
    model_parallel/ pipeline and tensor splits
    tasks/          classification metrics, segmentation
    check/          the distribution self-check
    app/            config, run_plan, factory and experiment (a run from a
                    config), export, evaluation, prediction
"""

import importlib
import importlib.util

# The public API: what a user needs to train from Python. Everything else is
# importable from its module (e.g. `framework.data.datasets.synthetic`).
_EXPORTS = {
    "framework.app.config": ["ExperimentConfig"],
    "framework.app.experiment": ["run"],
    "framework.app.export": ["describe_run"],
    "framework.core.gradients": ["AllReduceConfig"],
    "framework.core.controller": ["Controller", "LoopConfig", "enable_logging"],
    "framework.core.optimizers": ["OptimizerConfig"],
    "framework.core.actions": ["install_preemption_handler"],
    "framework.core.protocols": ["LoopEvaluator", "LoopTrainer"],
    "framework.core.trainer": ["Trainer", "masked_sum"],
    "framework.data.inputs": ["MaskedBatch", "pad_batches"],
    "framework.distribute.strategies": ["configure_cpu_devices",
                                        "make_strategy"],
    "framework.errors": ["CheckpointError", "ConfigError", "DataError",
                         "DistloopError", "NonFiniteLossError"],
    "framework.model_parallel.config": ["ModelParallelConfig"],
}
_WHERE = {name: module for module, names in _EXPORTS.items()
          for name in names}

__all__ = sorted(_WHERE)


def __getattr__(name):
  if name in _WHERE:
    value = getattr(importlib.import_module(_WHERE[name]), name)
  elif importlib.util.find_spec(f"framework.{name}"):
    # Layers (`framework.core`, ...) and `framework.errors` are attributes.
    value = importlib.import_module(f"framework.{name}")
  else:
    raise AttributeError(f"module 'framework' has no attribute {name!r}")
  globals()[name] = value
  return value


def __dir__():
  return sorted(set(globals()) | set(__all__))
