"""`--check_distribution` for a run: the self-check on an ExperimentConfig.

The check itself (`framework.check`) knows trainers and batches; this glue
builds them from a config the way `experiment.build` does.
"""

import dataclasses
import functools

import keras
import tensorflow as tf

import models
from framework.check import distribution_check
from framework.core import optimizers
from framework.data import inputs
from framework.distribute import strategies


def check_experiment(config, strategy, dataset, trainer_cls, *,
                     print_fn=print):
  """The check for an `ExperimentConfig` run (what `--check_distribution` does).

  Builds its own trainer under `strategy` and a reference on one device,
  exactly as `experiment.build` would, and checks them on the run's first
  global batch. The real run is untouched: `experiment.build` re-seeds.

  Raises:
    DistributionCheckError: the verdict is fail (the causes in the message).
  """
  optimizer_config = config.optimizer
  if optimizer_config.schedule == "cosine" and not optimizer_config.total_steps:
    optimizer_config = dataclasses.replace(optimizer_config, total_steps=1)
  batch = next(iter(inputs.train_dataset(dataset, config.global_batch_size,
                                         seed=config.seed)))
  build_model = lambda: models.build_model(
      config.model, dataset.input_shape, dataset.num_classes,
      **config.model_options)
  make_optimizer = lambda: optimizers.make_optimizer(optimizer_config)
  trainer_args = dict(global_batch_size=config.global_batch_size,
                      clip_norm=config.clip_norm,
                      nan_policy=config.nan_policy)
  split = config.model_parallel
  if split.mode == "none":
    report = distribution_check.check_trainer_class(
        trainer_cls, build_model, make_optimizer, strategy, batch,
        seed=config.seed, print_fn=print_fn, **trainer_args)
  else:
    # The split model against the unsplit step on one device; a tensor
    # split against its own shards all on one device (same variables).
    split_cls = split.trainer_factory(trainer_cls)
    reference_cls, reference_strategy = trainer_cls, strategies.make_strategy(
        "one_device")
    if split.mode == "tensor":
      devices = [strategies.make_strategy("one_device").extended.worker_devices[
          0]] * split.num_shards
      reference_cls = functools.partial(split_cls, devices=devices)
      reference_strategy = tf.distribute.get_strategy()

    def factory(cls, s):
      def make():
        with s.scope():
          model, optimizer = build_model(), make_optimizer()
        return cls(model, optimizer, s, **trainer_args)
      return make

    keras.utils.set_random_seed(config.seed)
    report = distribution_check.check_distribution(factory(split_cls, strategy),
                                factory(reference_cls, reference_strategy),
                                batch, print_fn=print_fn)
  if report.verdict == distribution_check.FAIL:
    raise distribution_check.DistributionCheckError(
        "distribution check failed: " +
        "; ".join(f"{c.code}: {c.message}" for c in report.causes))
  return report
