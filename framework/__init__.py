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
    app/            experiment (a run from a config), export, evaluation,
                    prediction
"""

import importlib
import importlib.util
import warnings

# The public API: what a user needs to train from Python. Everything else is
# importable from its module (e.g. `framework.data.datasets.synthetic`).
_EXPORTS = {
    "framework.app.experiment": ["ExperimentConfig", "run"],
    "framework.app.run_info": ["describe_run"],
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

# Names this package exported before its API was curated: still resolved,
# with a DeprecationWarning naming the module to import them from.
_MOVED = {
    "framework.core.checkpoints.manager": ["CheckpointManager"],
    "framework.data.datasets": ["ArrayDataset", "load_cifar10", "load_dataset",
                                "synthetic", "write_cifar10"],
    "framework.check.distribution_check": ["CheckReport",
                                           "DistributionCheckError",
                                           "check_distribution",
                                           "check_trainer_class"],
    "framework.data.file_input": ["FileDataset", "load_tfrecord"],
    "framework.data.image_folder": ["load_image_folder"],
    "framework.tasks.metrics": ["ConfusionTrainer"],
    "framework.data.inputs": ["distribute_eval", "distribute_train",
                              "eval_dataset", "train_dataset"],
    "framework.core.optimizers": ["make_optimizer"],
    "framework.distribute.strategies": ["STRATEGIES", "is_chief"],
    "framework.distribute.tf_config": ["parse_tf_config"],
    "framework.tasks.segmentation": ["SegmentationController",
                                     "SegmentationTrainer"],
    "framework.core.summaries": ["SummaryWriter"],
    "framework.core.trainer": ["sparse_categorical_loss"],
}
_MOVED_WHERE = {name: module for module, names in _MOVED.items()
                for name in names}

__all__ = sorted(_WHERE)


def __getattr__(name):
  if name in _WHERE:
    value = getattr(importlib.import_module(_WHERE[name]), name)
  elif name in _MOVED_WHERE:
    module = _MOVED_WHERE[name]
    warnings.warn(f"framework.{name} is deprecated: import it from {module}",
                  DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(module), name)
  elif importlib.util.find_spec(f"framework.{name}"):
    # Layers (`framework.core`, ...) and `framework.errors` are attributes.
    value = importlib.import_module(f"framework.{name}")
  else:
    raise AttributeError(f"module 'framework' has no attribute {name!r}")
  globals()[name] = value
  return value


def __dir__():
  return sorted(set(globals()) | set(__all__))
