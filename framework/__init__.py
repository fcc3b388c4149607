"""distloop: an explicit custom training loop on tf.distribute.

The public API is re-exported here and imported on first use (PEP 562), so
that TensorFlow-free modules such as `framework.launcher` load without
starting TensorFlow.
"""

import importlib
import importlib.util

_EXPORTS = {
    "framework.checkpointing": ["CheckpointManager"],
    "framework.controller": ["Controller", "LoopConfig"],
    "framework.datasets": ["ArrayDataset", "load_cifar10", "load_dataset",
                           "synthetic", "write_cifar10"],
    "framework.distribution_check": ["CheckReport", "DistributionCheckError",
                                     "check_distribution",
                                     "check_trainer_class"],
    "framework.experiment": ["ExperimentConfig"],
    "framework.file_input": ["FileDataset", "load_tfrecord"],
    "framework.image_folder": ["load_image_folder"],
    "framework.errors": ["CheckpointError", "ConfigError", "DataError",
                         "DistloopError", "NonFiniteLossError"],
    "framework.metrics": ["ConfusionTrainer"],
    "framework.inputs": ["distribute_eval", "distribute_train",
                         "eval_dataset", "train_dataset"],
    "framework.optimizers": ["OptimizerConfig", "make_optimizer"],
    "framework.strategies": ["STRATEGIES", "configure_cpu_devices",
                             "is_chief", "make_strategy", "parse_tf_config"],
    "framework.segmentation": ["SegmentationController",
                               "SegmentationTrainer"],
    "framework.summaries": ["SummaryWriter"],
    "framework.trainer": ["Trainer", "sparse_categorical_loss"],
}
_MODULES = ["experiment", "export", "segmentation", "segmentation_data"]
_WHERE = {name: module for module, names in _EXPORTS.items()
          for name in names}

__all__ = sorted(_WHERE) + _MODULES


def __getattr__(name):
  if name in _WHERE:
    value = getattr(importlib.import_module(_WHERE[name]), name)
  elif name in _MODULES or importlib.util.find_spec(f"framework.{name}"):
    # As the eager `import framework` did: submodules are attributes.
    value = importlib.import_module(f"framework.{name}")
  else:
    raise AttributeError(f"module 'framework' has no attribute {name!r}")
  globals()[name] = value
  return value


def __dir__():
  return sorted(set(globals()) | set(__all__))
