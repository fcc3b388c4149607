"""distloop: an explicit custom training loop on tf.distribute.

The public API is re-exported here and imported on first use (PEP 562), so
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

_EXPORTS = {
    "framework.core.checkpointing": ["CheckpointManager"],
    "framework.core.communication": ["AllReduceConfig"],
    "framework.core.controller": ["Controller", "LoopConfig"],
    "framework.data.datasets": ["ArrayDataset", "load_cifar10", "load_dataset",
                           "synthetic", "write_cifar10"],
    "framework.check.distribution_check": ["CheckReport", "DistributionCheckError",
                                     "check_distribution",
                                     "check_trainer_class"],
    "framework.app.experiment": ["ExperimentConfig"],
    "framework.data.file_input": ["FileDataset", "load_tfrecord"],
    "framework.data.image_folder": ["load_image_folder"],
    "framework.errors": ["CheckpointError", "ConfigError", "DataError",
                         "DistloopError", "NonFiniteLossError"],
    "framework.tasks.metrics": ["ConfusionTrainer"],
    "framework.data.inputs": ["MaskedBatch", "distribute_eval",
                              "distribute_train", "eval_dataset",
                              "pad_batches", "train_dataset"],
    "framework.core.optimizers": ["OptimizerConfig", "make_optimizer"],
    "framework.distribute.strategies": ["STRATEGIES", "configure_cpu_devices",
                                        "is_chief", "make_strategy"],
    "framework.distribute.tf_config": ["parse_tf_config"],
    "framework.tasks.segmentation": ["SegmentationController",
                               "SegmentationTrainer"],
    "framework.core.summaries": ["SummaryWriter"],
    "framework.core.trainer": ["Trainer", "masked_sum",
                               "sparse_categorical_loss"],
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
