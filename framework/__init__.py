"""distloop: an explicit custom training loop on tf.distribute."""

from framework.checkpointing import CheckpointManager
from framework.controller import Controller, LoopConfig
from framework.datasets import ArrayDataset, load_cifar10, load_dataset, synthetic, write_cifar10
from framework import experiment, export, segmentation, segmentation_data
from framework.distribution_check import CheckReport, DistributionCheckError, check_distribution, check_trainer_class
from framework.experiment import ExperimentConfig
from framework.errors import CheckpointError, ConfigError, DataError, DistloopError, NonFiniteLossError
from framework.metrics import ConfusionTrainer
from framework.inputs import distribute_eval, distribute_train, eval_dataset, train_dataset
from framework.optimizers import OptimizerConfig, make_optimizer
from framework.strategies import STRATEGIES, configure_cpu_devices, is_chief, make_strategy, parse_tf_config
from framework.segmentation import SegmentationController, SegmentationTrainer
from framework.summaries import SummaryWriter
from framework.trainer import Trainer, sparse_categorical_loss

__all__ = [
    "ArrayDataset", "CheckReport", "ConfusionTrainer",
    "DistributionCheckError", "ExperimentConfig", "experiment", "export",
    "segmentation", "segmentation_data", "SegmentationController",
    "SegmentationTrainer", "CheckpointError", "CheckpointManager",
    "ConfigError",
    "Controller", "DataError", "DistloopError", "LoopConfig",
    "NonFiniteLossError", "OptimizerConfig", "STRATEGIES", "SummaryWriter",
    "Trainer", "check_distribution", "check_trainer_class", "configure_cpu_devices", "distribute_eval", "distribute_train",
    "eval_dataset", "is_chief", "load_cifar10", "load_dataset",
    "make_optimizer", "make_strategy", "parse_tf_config",
    "sparse_categorical_loss", "synthetic", "train_dataset", "write_cifar10",
]
