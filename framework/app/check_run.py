"""`--check_distribution` for a run: the self-check on an ExperimentConfig.

The check itself (`framework.check`) knows trainers and batches; this glue
builds both sides with `factory.build_trainer`, the function that builds the
run's own trainer, so every feature the run uses (schedule, label smoothing,
accumulation, float16 loss scale, EMA, NaN policy) is in the checked step.
"""

import dataclasses
import functools

import keras
import tensorflow as tf

from framework.app import factory
from framework.app import run_plan
from framework.check import distribution_check
from framework.check.distribution_diagnosis import Finding
from framework.data import inputs
from framework.distribute import strategies


def check_experiment(config, strategy, dataset, trainer_cls=None, *,
                     build_model=None, make_trainer=None, print_fn=print,
                     plan=None):
  """The check for an `ExperimentConfig` run (what `--check_distribution` does).

  Builds a trainer under `strategy` and a reference on one device, exactly
  as the run builds its own, and checks them on the run's first global
  batch. The real run is untouched: its build re-seeds. A run computing in
  bfloat16 or float16 is checked in float32 (with its float16 loss scale):
  one step's low-precision rounding moves the weights by more than the
  check's tolerance between N replicas and one device.

  Args:
    trainer_cls, build_model, make_trainer: as for `experiment.run`.
    plan: the run's `RunPlan` (default: that of `config`, `strategy` and
      `dataset`), whose precision and task the check reads.

  Raises:
    DistributionCheckError: the verdict is fail (the causes in the message).
  """
  batch = next(iter(inputs.train_dataset(dataset, config.global_batch_size,
                                         seed=config.seed)))
  one_device = strategies.make_strategy("one_device")
  plan = plan or run_plan.RunPlan.of(config, strategy, dataset)
  config = plan.config
  compute = plan.precision
  notes = []
  if compute != "float32":
    notes.append(Finding(
        "compared_in_float32",
        f"the run computes in {compute}; the check built both sides in "
        "float32 (its rounding alone moves one step by more than the "
        "tolerance), so the low-precision compute itself is not covered"))

  if config.shard_optimizer_state and config.model_parallel.mode != "none":
    # The probe optimizer replaces copy 0's only: the other copies would
    # update their slices of the weights with the run's own optimizer.
    config = dataclasses.replace(config, shard_optimizer_state=False)
    notes.append(Finding(
        "checked_unsharded",
        "the run shards its optimizer state over the mesh's data axis; the "
        "check built both sides unsharded (its probe optimizer replaces "
        "the run's), so the sharded update itself is not covered (it "
        "equals the unsharded one: tests/test_optimizer_sharding_mesh.py)"))

  def factory_for(s, model_parallel=True, reference_cls=None):
    def make():
      trainer, _ = factory.build_trainer(
          config, s, dataset, trainer_cls, build_model=build_model,
          make_trainer=make_trainer or reference_cls,
          model_parallel=model_parallel,
          compute_precision="float32" if notes else None, plan=plan)
      return trainer
    return make

  split = config.model_parallel
  # Distributed: the run's trainer under `strategy` (or its model split);
  # the reference: the unsplit step on one device ...
  reference = factory_for(one_device, model_parallel=False)
  if split.mode == "tensor":
    # ... but a tensor split against its own shards all on one device (the
    # same variables).
    devices = [one_device.extended.worker_devices[0]] * split.num_shards
    split_cls = split.trainer_factory(
        trainer_cls or factory.default_trainer_cls(task=plan.task))
    reference = factory_for(tf.distribute.get_strategy(),
                            reference_cls=functools.partial(split_cls,
                                                            devices=devices))
  keras.utils.set_random_seed(config.seed)
  report = distribution_check.check_distribution(
      factory_for(strategy), reference, batch, notes=notes,
      print_fn=print_fn)
  if report.verdict == distribution_check.FAIL:
    raise distribution_check.DistributionCheckError(
        "distribution check failed: " +
        "; ".join(f"{c.code}: {c.message}" for c in report.causes))
  return report
